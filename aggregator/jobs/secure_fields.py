"""What every secure-aggregation job's config names: the SecAgg(+) group, its bounds, its keys.

Fed3R-Sync, secure FedAvg (head and tail) and secure LADD each run their rounds as SecAgg (or
SecAgg+) groups (``aggregator/jobs/secure_rounds.py``). One base config holds the fields they
share and loads the aggregator's identity and the enrolled device keys the files name; the jobs
whose devices send model updates (FedAvg, LADD) add a bound per trained entry.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from protocols.envelope import object_without_duplicates
from protocols.identity import DeviceIdentity, IdentityRegistry, check_curve_point
from protocols.secagg.config import GRAPHS, MAX_GROUP_SIZE, threshold_at_least
from protocols.secagg.fixedpoint import RING_BITS, RINGS
from protocols.topics import AGGREGATOR_ID

from aggregator.jobs.base import JobConfig
from aggregator.jobs.config_limits import MAX_SAMPLES, PATH, TIMEOUT_S, OneOf, Range, limited
from aggregator.jobs.input_files import read_job_input
from aggregator.jobs.privacy_fields import UpdateClippingFields

KEY_FILE_BYTES = 16 << 20        # a PEM key, or the enrolled devices' public keys (~100 bytes each)


@dataclass
class SecureAggregationFields(JobConfig):
    # "auto": the complete graph (SecAgg) up to 128 members, SecAgg+'s regular graph above
    # (protocols.secagg.config.resolve_graph); or "complete" / "regular" whatever the size
    graph: str = limited("auto", OneOf(GRAPHS))
    # SecAgg+: the degree and share threshold are chosen to survive it
    expected_dropout: float = limited(0.1, Range(0, 0.49))
    # distributed DP: the share of a group that must survive for its sum to be revealed; each member
    # adds σ²/t, so a group whose members all survive holds κ/t times the release's noise variance
    # (1.5 at SecAgg's t = ⌈2κ/3⌉, the default 0): a larger share is less noise, and a group with more
    # drop-outs than it allows fails (nothing released; its devices may be asked again)
    dp_group_threshold: float = limited(0.0, Range(0, 1))
    # the SecAgg ring Z_{2^r}: 64 bits, or 32 where the bound and the precision the job needs allow
    # it (half the masked bytes and half the mask keystream; the finest scale that fits is used)
    ring_bits: int = limited(RING_BITS, OneOf(RINGS))
    # per device; with the per-entry bound it fixes the vector's bound
    max_samples: int = limited(10_000, MAX_SAMPLES)
    # a phase gives up on its missing members this long after its last answer; the first, which
    # holds the members' local work, at its share of round_timeout_s (aggregator/jobs/phase_clock.py)
    phase_timeout_s: float = limited(30.0, TIMEOUT_S)
    # masked inputs being uploaded at once, in bytes: the rest wait their turn
    # (aggregator/jobs/upload_window.py); half the aggregator's 1 GiB reassembly buffer
    upload_window_bytes: int = limited(512 * 2**20, Range(2**20, 2**40))
    identity_file: str = limited("", PATH)          # aggregator's Ed25519 private key (PEM)
    device_keys_file: str = limited("", PATH)       # JSON {device id: Ed25519 public key, hex}

    def __post_init__(self):
        super().__post_init__()
        # each round is one group of clients_per_round members: one the protocol refuses (and its
        # devices with it) is a config error now, not a round that fails each time it opens
        if self.clients_per_round > MAX_GROUP_SIZE:
            raise ValueError(f"clients_per_round is {self.clients_per_round:,}: a secure round's group has at most "
                             f"{MAX_GROUP_SIZE} members (protocols/secagg/config.py MAX_GROUP_SIZE)")

    def refuse_inert_group_threshold(self, dp: bool) -> None:
        """``dp_group_threshold`` only sizes distributed DP's noise shares: on a job without DP
        (``dp``, its own family's flag) it would change nothing, so setting it is an error, not a no-op."""
        if self.dp_group_threshold and not dp:
            raise ValueError("dp_group_threshold applies to distributed DP only: set dp_noise_multiplier > 0, "
                             "or leave dp_group_threshold at 0")

    def secure_vector_length(self) -> int | None:
        """The length of the vector each member masks, from the config alone, or None where it takes
        the initial model (a tail program's tensors, LADD's network): a config that says it is held
        to SecAgg's limits wherever it is accepted (``secure_rounds.config_vector_length``: the
        admin API, ``aggregator serve --config``), not first when the stored job is built."""
        return None

    def secure_vector_remedy(self) -> str:
        """What shortens this kind's secure vector, said (with the fields to change) when it is refused."""
        return "train a smaller model (num_classes x feature_dim)"

    def group_threshold(self, members: int) -> int:
        """t of a distributed-DP group of ``members``: SecAgg's ⌈2κ/3⌉, or more (``dp_group_threshold``)."""
        return threshold_at_least(members, self.dp_group_threshold)

    def load_identities(self) -> tuple[DeviceIdentity, IdentityRegistry]:
        """The aggregator's identity (``identity_file``) and the enrolled device keys (``device_keys_file``)."""
        identity = DeviceIdentity.from_pem(AGGREGATOR_ID, read_job_input(self.identity_file, "identity_file",
                                                                          KEY_FILE_BYTES))
        text = read_job_input(self.device_keys_file, "device_keys_file", KEY_FILE_BYTES)
        try:       # a device named twice would keep its last key: refused, as every JSON file a user names
            keys = json.loads(text, object_pairs_hook=object_without_duplicates)
            if not isinstance(keys, dict) or not all(isinstance(k, str) for k in keys.values()):
                raise ValueError("expected an object of device id -> hex public key")
            registry = IdentityRegistry({d: bytes.fromhex(k) for d, k in keys.items()})
            for device in registry:          # a mistyped key: refused here, not each of its device's messages
                try:
                    check_curve_point(registry.public_key(device))
                except ValueError as exc:
                    raise ValueError(f"{device!r}: {exc}") from None
            return identity, registry
        except (ValueError, UnicodeDecodeError, RecursionError) as exc:
            raise ValueError(f"device_keys_file {self.device_keys_file}: {exc}") from None


@dataclass
class SecureUpdateFields(SecureAggregationFields, UpdateClippingFields):
    """Model updates summed under SecAgg: a bound per trained entry, and under DP the clip norm
    (adaptive where the kind's devices send their clipped-indicator bits: ``clip_bit_entries``)."""

    max_abs_param: float = limited(100.0, Range(1e-6, 1e6))   # per trained entry, after local training

    def __post_init__(self):
        super().__post_init__()
        self.refuse_inert_group_threshold(self.dp)
        # Distributed DP: the devices clip and noise (no central noise); under adaptive clipping
        # each also sends its clipped-indicator bit, noised, in one more entry (clip_bit_entries)
        if self.dp and self.dp_population:
            # amplification by sampling holds only against whoever cannot see the sample; distributed
            # DP guards against the server, and the server draws it (a review's finding)
            raise ValueError("dp_population must be 0 under secure aggregation: the aggregator draws each "
                             "round's devices, so the sampling cannot hide them from it (no amplification)")
        if self.dp and self.ring_bits != RING_BITS:
            # the devices' Skellam noise is scaled to about 2^20 ring units (distributed_dp.py)
            raise ValueError(f"distributed DP needs the {RING_BITS}-bit ring (ring_bits = {RING_BITS})")

    def clip_bit_entries(self) -> int:
        """Entries a device's vector holds beyond the update's for adaptive clipping under distributed
        DP: its clipped-indicator bit (``protocols/secagg/distributed_dp.py`` clip_bit), or none."""
        return 1 if self.dp and self.dp_adaptive_clip else 0
