"""Which bucket a device belongs to, and which shard owns a bucket.

The canonical sum of an order-free job (Fed3R) is defined on *buckets*, not on shards, so that
it does not depend on how many shards there are: a device's bucket is a fixed hash of its id
modulo ``NUM_BUCKETS``; a bucket's sum is its contributions in (device id, round) order starting
from zero; the model's sum is the bucket sums added pairwise up a fixed binary tree over the
buckets (``partial_sums.py``). A shard owns a contiguous range of whole buckets, so K shards
compute exactly the additions one aggregator computes, and each sends only the sums of the
largest subtrees inside its range (at most 2·log2(NUM_BUCKETS) arrays), not one per bucket.

The hash is BLAKE2b of the id's UTF-8 bytes: stable across processes, machines and Python versions
(``hash()`` is salted per process), and spreading device ids evenly whatever their naming scheme.
"""

from __future__ import annotations

import hashlib

NUM_BUCKETS = 64        # fixed for ever: changing it changes the last bits of every reported model


def bucket_of(device: str, num_buckets: int = NUM_BUCKETS) -> int:
    digest = hashlib.blake2b(device.encode("utf-8"), digest_size=8).digest()
    return int.from_bytes(digest, "big") % num_buckets


def check_shard_count(shards: int, num_buckets: int = NUM_BUCKETS) -> None:
    """ValueError unless ``shards`` shards can each own a range of buckets (1 to ``num_buckets``)."""
    if not 1 <= shards <= num_buckets:
        raise ValueError(f"shards must be between 1 and {num_buckets}, got {shards}")


def bucket_range(shard: int, shards: int, num_buckets: int = NUM_BUCKETS) -> tuple[int, int]:
    """The buckets ``[lo, hi)`` shard ``shard`` of ``shards`` owns: a contiguous range, so that it
    sums whole subtrees of the reduction tree itself (``partial_sums.py``)."""
    check_shard_count(shards, num_buckets)
    if not 0 <= shard < shards:
        raise ValueError(f"shard {shard} is not one of 0..{shards - 1}")
    return shard * num_buckets // shards, (shard + 1) * num_buckets // shards


def shard_of_bucket(bucket: int, shards: int) -> int:
    return next(s for s in range(shards) if bucket < bucket_range(s, shards)[1])


def shard_of(device: str, shards: int) -> int:
    """The shard (0 .. shards-1) that ingests ``device``'s results."""
    return shard_of_bucket(bucket_of(device), shards)


def canonical_key(device: str, round_: int) -> tuple[int, str, int]:
    """Where a contribution comes in the canonical sum: bucket, then device id, then round."""
    return bucket_of(device), device, round_


def shard_role(index: int) -> str:
    """Shard ``index``'s connection role: its own broker account ``aggregator/shard<i>`` where the
    broker has accounts (a broker that forces the client id to the user name let each shard take
    the service's ``aggregator`` session over, and the service take it back, for ever)."""
    return f"shard{index}"
