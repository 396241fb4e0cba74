"""The aggregator service's settings: one frozen object, each field's limit declared where it is.

:class:`ServiceSettings` holds the scalar knobs and policies of :class:`~aggregator.service.loop.AggregatorService`
(how often it ticks, how it chunks, whether it requires signatures, checkpoints, keeps serving, ...). Each field
declares its limit with the mechanism job configs use (``limited(default, Range(...))``,
``aggregator/jobs/config_limits.py``), and construction checks every field with that mechanism's
:func:`~aggregator.jobs.config_limits.validate_config`: a bad value (``tick_s=0``, a negative chunk
size, NaN, a string for a number, 1 for a flag) is refused with one ``ValueError`` naming the field,
before a service is built. Each entry point builds one: ``aggregator/cli.py`` from its options, the
LADD simulation's aggregator process from its spec, a test from what it varies.

What the service is *given* rather than *set to* stays explicit keyword arguments of the service:
the job, the broker, the output folder, the store, the broker's security files, the artifact shelf,
the aggregator's identity, the shard pool, the enrolled devices and the evaluation set. They are
objects with lives of their own, most of them shared with the service's neighbours (the store with
the admin API and the deployment controller, the security files with the broker, the shards with
their processes), each of a type that says what it is; a second bag object would only add a name
at every call site, while a keyword names exactly what each site lends. Settings, by contrast, are
values: comparable, printable, limited, and the same object can configure many services.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from protocols.chunking import DEFAULT_CHUNK_SIZE
from protocols.message_loop import QueueBound
from protocols.topics import TOPIC_ROOT_PATTERN, Topics

from aggregator.jobs.config_limits import FLAG, Pattern, Range, limited, validate_config

# a topic root: protocols/topics.py's one rule (the devices and the broker's ACLs check the same)
TOPIC_ROOT = Pattern(TOPIC_ROOT_PATTERN)


@dataclass(frozen=True)
class ServiceSettings:
    topic_root: str = limited("fedfleet", TOPIC_ROOT)
    # bytes of one MQTT publish the service sends (a larger message goes in chunks); the broker's
    # packet limit (256 MiB for MQTT) bounds it above
    chunk_size: int = limited(DEFAULT_CHUNK_SIZE, Range(1024, 128 * 2 ** 20))
    # the largest message a device may send, reassembled: the memory one sender may make us hold
    max_message_bytes: int = limited(256 * 2 ** 20, Range(1024, 16 * 2 ** 30))
    # the service thread's idle wake-up: deadlines, expiries and the live snapshot move at this pace
    tick_s: float = limited(0.2, Range(1e-3, 60))
    # evaluate after every contribution (else once per round: large fleets)
    evaluate_every_contribution: bool = limited(True, FLAG)
    # accept only messages signed with the sender's enrolled Ed25519 key
    require_signatures: bool = limited(False, FLAG)
    # after the job, keep running and start the jobs queued through the API
    keep_serving: bool = limited(False, FLAG)
    # store a checkpoint at each round close, so a restart replays one round, not the job
    checkpoints: bool = limited(True, FLAG)
    # a device offline for longer than this (or revoked) no longer keeps a job from finishing
    offline_grace_s: float = limited(120.0, Range(0, 7 * 86400))
    # processes that decode and validate large results (0: on the service thread)
    ingest_workers: int = limited(0, Range(0, 256))
    # how long ``--shards`` waits for every shard to start and connect to the broker before the
    # service fails its start: two Ray actors took over 120 s on a loaded 2-core machine
    shard_start_timeout_s: float = limited(300.0, Range(1, 3600))
    # tries of a job's end that fails for now (a disk's error, the memory's) before the job fails saying
    # so (aggregator/service/end_failures.py): with the growing waits between them (1 s doubling to
    # 60 s, service/backoff.py) the default gives an operator about 25 minutes to mend what failed
    end_attempts: int = limited(30, Range(1, 10_000))

    def __post_init__(self):
        validate_config("aggregator service", ServiceSettings, dataclasses.asdict(self))

    @property
    def topics(self) -> Topics:
        """The topic layout under :attr:`topic_root`."""
        return Topics(self.topic_root)

    @property
    def inbound_bound(self) -> QueueBound:
        """What may wait unread in the service's queue: per topic (one device) its largest message
        and a little more (a result in flight and its protocol messages), in all 2 GiB or four such
        messages (a secure round's upload window, 512 MiB, stays well inside it)."""
        per_device = self.max_message_bytes + 16 * 2 ** 20
        return QueueBound(per_device, max(2 * 2 ** 30, 4 * per_device))
