"""Which shard hosts a secure group, and which secure jobs shards can host: the capability a
secure kind's registry entry declares (``JobKind.shard_groups`` in ``aggregator/jobs/registry.py``).
How it runs: ``secure_groups.py`` (the coordinator's side, its theory of operation) and
``shard_groups.py`` (a shard's side)."""

from __future__ import annotations

from typing import Any


class SecureGroupPlacement:
    """A secure job (``SecureGroupRounds``) whose every round is one SecAgg(+) group: shards host
    the groups' server machines, the coordinator applies their unmasked sums."""

    def refusal(self, job: Any) -> str:
        """Why shards cannot host this job's groups ("" when they can)."""
        if not job.secure_rounds:
            return f"{type(job).__name__} runs no secure groups: shards cannot host them"
        if job.config.dp:
            # a group's sum the coordinator drops at its deadline, after the host unmasked it, would
            # leave its devices eligible for a second noisy sum the accountant never counts
            return f"{type(job).__name__} with differential privacy does not run on shards"
        return ""

    @staticmethod
    def shard_of(round_id: int, shards: int) -> int:
        """The shard hosting round ``round_id``'s group: consecutive groups on consecutive shards
        (a fixed rule, so a restarted coordinator places a group where it placed it before)."""
        if shards < 1 or round_id < 0:
            raise ValueError(f"no shard for round {round_id} of {shards} shards")
        return round_id % shards
