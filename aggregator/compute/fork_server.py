"""Where the aggregator's worker processes come from: one ``multiprocessing`` fork server per
service, started at the first worker, that imports the workers' modules (the job code, torch)
once. A worker is then a fork of it: it starts, or restarts after it died, in milliseconds
instead of an interpreter's imports (seconds of CPU each; ``bench/shard_start.py``), and the
workers share those imports' memory copy-on-write. Never a fork of the service itself, whose
threads (MQTT, HTTP) may hold locks a child would inherit held.

The local shards (``aggregator/shards/local.py``), the ingest workers
(``aggregator/service/ingest.py``) and the CPU mask applier (``mask_expansion.py``) name the
module their workers run; the server imports every module named before it started (Python starts
one server per process: a module named later is imported by each worker that needs it).
"""

from __future__ import annotations

import multiprocessing

_PRELOAD: list[str] = []


def fork_server_context(*modules: str):
    """The fork-server context, ``modules`` added to what its server imports when it starts."""
    _PRELOAD.extend(m for m in modules if m not in _PRELOAD)
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(list(_PRELOAD))
    return context
