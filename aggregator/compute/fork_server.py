"""Where the aggregator's worker processes come from: one ``multiprocessing`` fork server per
service, that holds the workers' modules (the job code, torch) imported once. A worker is then a
fork of it: it starts, or restarts after it died, in milliseconds instead of an interpreter's
imports (seconds of CPU each; ``bench/shard_start.py``), and the workers share those imports'
memory copy-on-write. Never a fork of the running service itself, whose threads (MQTT, HTTP) may
hold locks a child would inherit held.

Two ways the server starts:

- ``start_fork_server_here()``, called by ``aggregator serve`` when it will have workers, before
  its first thread and before anything touches CUDA (a job is built, a device picked): the server
  is a fork of the service at that point, so it inherits every module the service has imported
  (no interpreter start, no second torch import: ~1.6 CPU-s a service, ``bench/shard_start.py``);
- otherwise multiprocessing's own, at the first worker: a fresh interpreter that imports the
  modules named so far.

The local shards (``aggregator/shards/local.py``), the ingest workers
(``aggregator/service/ingest.py``) and the CPU mask applier (``mask_expansion.py``) name the
module their workers run; the server imports every module named before it started (Python starts
one server per process: a module named later is imported by each worker that needs it).
"""

from __future__ import annotations

import importlib
import inspect
import logging
import multiprocessing
import os
import socket
import sys
import threading
from multiprocessing import connection, forkserver, resource_tracker, util

log = logging.getLogger("fedfleet.aggregator.fork_server")

_PRELOAD: list[str] = ["torch"]     # what every worker computes with (the job code imports it where used)

# The workers' modules: what a service's own server imports before it forks (and torch: _PRELOAD).
WORKER_MODULES = ("aggregator.shards.local", "aggregator.service.ingest", "aggregator.compute.mask_expansion")

# multiprocessing.forkserver's internals that start_fork_server_here fills in, as CPython 3.11–3.13
# lay them out (3.14 adds an authentication key to the handshake): on any other layout the service
# keeps multiprocessing's own server.
_SERVER_MAIN_PARAMETERS = ["listener_fd", "alive_r", "preload", "main_path", "sys_path"]
_SERVER_STATE = ("_forkserver_address", "_forkserver_alive_fd", "_forkserver_pid", "_preload_modules")


def fork_server_context(*modules: str):
    """The fork-server context, ``modules`` added to what its server imports when it starts."""
    _PRELOAD.extend(m for m in modules if m not in _PRELOAD)
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(list(_PRELOAD))
    return context


def can_fork_server_here() -> bool:
    """Whether this process may become its own fork server's parent: one Python thread (a fork copies
    only the caller's; a lock another thread holds would stay held in every worker; the BLAS
    libraries' own pool threads, started at import, stop and restart around a fork by themselves),
    CUDA not initialised (a fork of a process that has it cannot use CUDA, and a worker's job may
    run on the GPU), no server started yet, and the multiprocessing layout this module knows."""
    server = forkserver._forkserver
    torch = sys.modules.get("torch")
    cuda_initialised = torch is not None and torch.cuda.is_initialized()     # asks, never initialises
    return (threading.active_count() == 1 and not cuda_initialised
            and all(hasattr(server, name) for name in _SERVER_STATE)
            and server._forkserver_pid is None
            and list(inspect.signature(forkserver.main).parameters) == _SERVER_MAIN_PARAMETERS)


def start_fork_server_here(modules: tuple[str, ...] = WORKER_MODULES) -> int | None:
    """Make this process's fork server a fork of this process, ``modules`` imported first; the pid
    of the server, or None (and nothing done) where :func:`can_fork_server_here` says no. Then
    :func:`fork_server_context`'s workers are forks of it, as with multiprocessing's own server:
    the same protocol, the same pipe that ends it when its last client is gone."""
    if not can_fork_server_here():
        log.debug("fork server: multiprocessing's own (this process has threads or CUDA, or an unknown layout)")
        return None
    for name in (*_PRELOAD, *modules):
        importlib.import_module(name)
    fork_server_context(*modules)
    server = forkserver._forkserver
    opened: list = []
    try:
        resource_tracker.ensure_running()      # as multiprocessing's start does: its fd goes to each worker
        listener = socket.socket(socket.AF_UNIX)
        opened.append(listener.close)
        address = connection.arbitrary_address("AF_UNIX")
        listener.bind(address)
        if not util.is_abstract_socket_namespace(address):
            os.chmod(address, 0o600)
        listener.listen()
        alive_r, alive_w = os.pipe()     # every client holds the write end; EOF ends the server
        opened += [lambda: os.close(alive_r), lambda: os.close(alive_w)]
        pid = os.fork()                  # no lock taken around it: one thread, so none is held in the child
    except OSError as exc:               # no socket, pipe or process to spare: the first worker starts one
        for close in opened:
            close()
        log.warning("fork server: cannot start one here (%s); the first worker starts multiprocessing's own", exc)
        return None
    if pid == 0:
        _serve(listener, alive_r, alive_w)
    listener.close()
    os.close(alive_r)
    server._forkserver_address, server._forkserver_alive_fd, server._forkserver_pid = address, alive_w, pid
    return pid


def _serve(listener: socket.socket, alive_r: int, alive_w: int) -> None:
    """The server's side of the fork: multiprocessing's server loop, then out without the
    interpreter's teardown (what it would tear down is the service's, inherited)."""
    code = 0
    try:
        os.close(alive_w)
        forkserver.main(listener.detach(), alive_r, list(_PRELOAD))
    except SystemExit:          # how the loop ends: its last client is gone
        pass
    except BaseException:
        code = 1
        log.exception("fork server failed")
    finally:
        os._exit(code)
