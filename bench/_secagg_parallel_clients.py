"""A SecAgg round whose clients run in parallel worker processes, for the Flower comparison.

protocols.secagg.driver.run_round runs the clients one after another in one process. Flower's
simulation runs its ClientApps on several Ray actors at once; to compare like with like,
`run_round_parallel` spreads the same ClientSecAgg objects over `processes` forked workers (each
device lives in one worker for the whole round, keeping its state) and the server stays in this
process. Everything else is the driver's: `build_round` makes the server and the clients,
`client_step` delivers a frame to a device (dropouts included), every message travels as its
`WireFrame`, and a phase that cannot close gets the driver's `Timeout`. Replies reach the server
as soon as any worker produced them.
"""

from __future__ import annotations

import multiprocessing
import time
from dataclasses import dataclass
from multiprocessing.connection import wait

from protocols.secagg import Phase
from protocols.secagg.driver import RoundRun, WireFrame, client_step, build_round
from protocols.secagg.events import Timeout
from protocols.secagg.messages import Message
from protocols.secagg.server import FINAL_STATES


@dataclass
class ParallelRun:
    outcome: object
    wall_seconds: float          # server.start() to the outcome, on this process's clock
    client_cpu_seconds: float    # summed over the workers' client steps
    server_cpu_seconds: float    # this process (server + dispatch), all its threads
    errors: list


def _worker(connection, config, server_identity, identities, inputs, dropouts, shard):
    _, clients = build_round(config, server_identity, identities)
    clients = {device: client for device, client in clients.items() if device in shard}
    silent = {device for device, phase in dropouts.items() if phase is Phase.ADVERTISE_KEYS}
    run = RoundRun(outcome=None, server=None, clients=clients)  # type: ignore[arg-type]  # errors only
    while (batch := connection.recv()) is not None:
        for frame in batch:
            started = time.process_time()
            uploads = [WireFrame.from_message(reply)
                       for reply in client_step(frame, clients, silent, dropouts, inputs, run)]
            connection.send((uploads, time.process_time() - started))
    connection.send([f"{who}: {type(error).__name__}: {error}" for who, error in run.errors])


def run_round_parallel(config, server_identity, identities, inputs, *, dropouts, processes: int,
                       server_workers: int, server_mask_applier=None) -> ParallelRun:
    """`inputs(device)` is called in the worker that holds the device (the workers are forked, so
    it may close over anything of this process)."""
    server, _ = build_round(config, server_identity, identities, server_workers, server_mask_applier)
    members = list(config.members)
    shards = [set(members[i::processes]) for i in range(processes)]
    worker_of = {device: i for i, shard in enumerate(shards) for device in shard}
    context = multiprocessing.get_context("fork")
    connections, workers = [], []
    for shard in shards:
        ours, theirs = context.Pipe()
        worker = context.Process(target=_worker, args=(theirs, config, server_identity, identities, inputs,
                                                       dict(dropouts), shard), daemon=True)
        worker.start()
        theirs.close()
        connections.append(ours)
        workers.append(worker)
    client_cpu = 0.0
    try:
        started_cpu, started = time.process_time(), time.perf_counter()
        outputs = server.start()
        while server.state not in FINAL_STATES:
            phase = server.phase
            batches: list[list[WireFrame]] = [[] for _ in shards]
            for message in outputs:
                if isinstance(message, Message):
                    batches[worker_of[message.recipient]].append(WireFrame.from_message(message))
            outputs = []
            pending = {connection: len(batch) for connection, batch in zip(connections, batches) if batch}
            for connection, batch in zip(connections, batches):
                if batch:
                    connection.send(batch)
            while pending:
                for connection in wait(list(pending)):
                    uploads, seconds = connection.recv()
                    client_cpu += seconds
                    pending[connection] -= 1
                    if not pending[connection]:
                        del pending[connection]
                    for upload in uploads:
                        outputs.extend(server.handle(upload.to_message()))
            if server.phase == phase and server.state not in FINAL_STATES:
                outputs.extend(server.handle(Timeout(phase)))
        wall = time.perf_counter() - started
        server_cpu = time.process_time() - started_cpu
        errors = []
        for connection in connections:
            connection.send(None)
            errors.extend(connection.recv())
    finally:
        for worker in workers:
            worker.join(timeout=10)
            if worker.is_alive():
                worker.kill()
    return ParallelRun(server.outcome, wall, client_cpu, server_cpu, errors)
