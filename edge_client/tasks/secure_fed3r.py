"""``fed3r.secure``: Fed3R-Sync on the device — statistics summed with the group's under SecAgg.

On the task the device computes its dense statistics (the same ``Fed3RStatsTask`` as plain
Fed3R), packs them into the fixed-shape vector of ``protocols.payloads.secagg``, checks them
against the round's bound and becomes a ``ClientSecAgg`` for (job, round, group). Every
``secagg`` message from the aggregator is then fed to that client; its replies go back as
envelopes. The aggregator never sees the vector itself, only masked values and the group sum.
"""

from __future__ import annotations

import logging


from protocols.envelope import Envelope
from protocols.identity import DeviceIdentity
from protocols.payloads.secagg import from_envelope, pack_sync_vector, to_envelope
from protocols.secagg import ClientSecAgg, SecAggError

from ..agent import TaskDeclined
from .fed3r_stats import Fed3RStatsTask

log = logging.getLogger("fedfleet.device.secagg")


class SecureFed3R:
    """A protocol handler for the agent: ``on_task`` and ``on_message`` return envelopes to send."""

    def __init__(self, identity: DeviceIdentity, aggregator_public_key: bytes, stats: Fed3RStatsTask,
                 max_sessions: int = 4):
        self.identity = identity
        self.aggregator_public_key = aggregator_public_key
        self.stats = stats
        self.max_sessions = max_sessions
        self.sessions: dict[tuple[str, int, str], ClientSecAgg] = {}

    def on_task(self, job: str, round_: int, params: dict) -> list[Envelope]:
        body, tensors = self.stats(dict(params, format="dense", dtype="float64"))
        n = body["n"]
        if n > int(params["max_samples"]):
            raise TaskDeclined(f"{n} local samples exceed the round's bound of {params['max_samples']}")
        vector = pack_sync_vector(tensors["A_upper"], tensors["b"], n)
        key = (job, round_, str(params["group"]))
        client = ClientSecAgg(self.identity, "aggregator", self.aggregator_public_key, job_id=job,
                              round_id=round_, group_id=key[2], input_vector=vector)
        self.sessions[key] = client
        while len(self.sessions) > self.max_sessions:          # forget the oldest rounds
            self.sessions.pop(next(iter(self.sessions)))
        return []

    def on_message(self, env: Envelope) -> list[Envelope]:
        msg = from_envelope(env)
        client = self.sessions.get((msg.job_id, msg.round_id, msg.group_id))
        if client is None:
            log.info("%s: secagg message for an unknown session %s/%s/%s", self.identity.device_id,
                     msg.job_id, msg.round_id, msg.group_id)
            return []
        try:
            return [to_envelope(r) for r in client.handle(msg)]
        except SecAggError as exc:
            log.warning("%s: secagg error: %s", self.identity.device_id, exc)
            return []


__all__ = ["SecureFed3R"]
