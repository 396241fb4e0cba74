"""Which bucket a device belongs to, and which shard owns a bucket.

The canonical sum of an order-free job (Fed3R) is defined on *buckets*, not on shards, so that
it does not depend on how many shards there are: a device's bucket is a fixed hash of its id
modulo ``NUM_BUCKETS``; a bucket's sum is its contributions in (device id, round) order starting
from zero; the model's sum is the bucket sums added in bucket order. A shard owns whole buckets
(``bucket % K == shard``), so K shards compute exactly the additions one aggregator computes.

The hash is BLAKE2b of the id's UTF-8 bytes: stable across processes, machines and Python versions
(``hash()`` is salted per process), and spreading device ids evenly whatever their naming scheme.
"""

from __future__ import annotations

import hashlib

NUM_BUCKETS = 64        # fixed for ever: changing it changes the last bits of every reported model


def bucket_of(device: str, num_buckets: int = NUM_BUCKETS) -> int:
    digest = hashlib.blake2b(device.encode("utf-8"), digest_size=8).digest()
    return int.from_bytes(digest, "big") % num_buckets


def shard_of_bucket(bucket: int, shards: int) -> int:
    if shards < 1:
        raise ValueError(f"shards must be >= 1, got {shards}")
    return bucket % shards


def shard_of(device: str, shards: int) -> int:
    """The shard (0 .. shards-1) that ingests ``device``'s results."""
    return shard_of_bucket(bucket_of(device), shards)


def canonical_key(device: str, round_: int) -> tuple[int, str, int]:
    """Where a contribution comes in the canonical sum: bucket, then device id, then round."""
    return bucket_of(device), device, round_
