"""Aggregation beyond one process: the canonical bucketed order (``buckets.py``), the reduction
tree (``sum_tree.py``), bucket sums and their reduction to a job (``partial_sums.py``), a FedAvg
round's sums (``fedavg_sums.py``), one shard's ingest (``shard.py``), the coordinator's side of K
shards (``pool.py``; the job it serves: ``coordinator_job.py``, ``coordinator_rounds.py``) and what
runs them: local processes (``local.py``) or Ray actors (``ray_shards.py``); secure jobs' SecAgg
groups hosted on shards (``secure_groups.py``, ``shard_groups.py``, ``group_placement.py``).
docs/architecture.md, "Shards"."""
