"""Aggregation beyond one process: the canonical bucketed order (``buckets.py``), bucket sums and
their reduction (``partial_sums.py``), one shard's ingest (``shard.py``), the coordinator's side of
K shards (``pool.py``) and what runs them: local processes (``local.py``) or Ray actors
(``ray_shards.py``). docs/architecture.md, "Shards"."""
