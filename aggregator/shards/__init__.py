"""Aggregation beyond one process: the canonical bucketed order (``buckets.py``), bucket sums and
their reduction (``partial_sums.py``), one shard's ingest (``shard.py``) and the local processes
that run K of them (``local.py``). docs/architecture.md, "Shards"."""
