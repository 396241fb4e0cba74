"""One Flower SecAgg+ round, timed, for bench/secagg.py's comparison (run by a Flower venv's python).

Never imported by fedfleet and never a dependency of it: `make bench-flower` makes the git-ignored
.venv-flower (flwr[simulation]==1.42.0, numpy) and bench/secagg.py runs this file with its python.

What runs is Flower's own code path, unchanged: `flwr.simulation.run_simulation` (the Ray backend)
with a legacy ServerApp whose DefaultWorkflow has `SecAggPlusWorkflow` as its fit workflow, and a
ClientApp whose mods are `secaggplus_mod` (plus the dropout mod below). n virtual clients each hold a
float64 vector of m values, the same vectors fedfleet's bench sums: base * ((i % 97) + 1) / 97 with
base = default_rng(0).uniform(-1, 1, m), i the client's partition id.

Dropouts: every client whose partition id is a multiple of round(1 / dropout) (10 of 100 at 10 %, as
fedfleet's bench picks members[::10]) raises when asked for its masked vector, i.e. it received its
forwarded key shares and never sends its masked input -- fedfleet's `--dropout-after masked_input`.
The simulation turns the exception into an error reply and the workflow drops the client from the
active set, so the server has to rebuild its pair masks with its surviving neighbours.

Timed: the fit workflow (the four SecAgg+ stages: setup, share keys, collect masked vectors,
unmask) on the server's clock, after a warm-up message to every client so that Ray's start-up and
the actors' first call stay outside. The strategy's aggregate_fit only hands on the workflow's
aggregate (a FedAvg over the identical unmasked vectors would add work that is not SecAgg+).

Also counted: each ClientApp call's CPU seconds (process_time in its Ray actor, sent back in an extra
record of the reply that the workflow ignores) and the server process's CPU seconds during the round.

Checked: the aggregate the workflow returns (the mean over the survivors, dequantised) times the
number of survivors against the plain float sum of the survivors' vectors; the tolerance is what
stochastic rounding to Flower's quantisation step allows (one step per survivor and value).

Prints one JSON object (also written to --json-out).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import numpy as np

os.environ.setdefault("RAY_DEDUP_LOGS", "0")

from flwr.client import ClientApp, NumPyClient  # noqa: E402
from flwr.client.mod import secaggplus_mod  # noqa: E402
from flwr.app import ConfigRecord, Message  # noqa: E402
from flwr.common import GetPropertiesIns, ndarrays_to_parameters, parameters_to_ndarrays  # noqa: E402
from flwr.common.constant import MessageTypeLegacy  # noqa: E402
from flwr.common.secure_aggregation.secaggplus_constants import RECORD_KEY_CONFIGS, Key, Stage  # noqa: E402
from flwr.compat.common import recorddict_compat as compat  # noqa: E402
from flwr.server import LegacyContext, ServerApp, ServerConfig  # noqa: E402
from flwr.server.strategy import FedAvg  # noqa: E402
from flwr.server.workflow import DefaultWorkflow, SecAggPlusWorkflow  # noqa: E402
from flwr.simulation import run_simulation  # noqa: E402

BOUND = 1.0        # fedfleet's bench bound; Flower's clipping_range
CPU_RECORD = "bench-cpu"
MAX_WEIGHT = 1000  # every client reports num_examples = max_weight: weight ratio 1, no rescaling


def client_vector(partition_id: int, base: np.ndarray) -> np.ndarray:
    return base * ((partition_id % 97) + 1) / 97


def dropped(partition_id: int, n: int, dropout: float) -> bool:
    step = max(1, round(1 / dropout)) if dropout > 0 else 0
    return bool(step) and partition_id % step == 0 and partition_id // step < round(dropout * n)


def build(args) -> tuple[ServerApp, ClientApp, dict]:
    result: dict = {}
    bases: dict[int, np.ndarray] = {}

    class VectorClient(NumPyClient):
        def __init__(self, partition_id: int):
            self.partition_id = partition_id

        def fit(self, parameters, config):
            if args.m not in bases:   # once per Ray actor, as fedfleet's bench draws base once
                bases[args.m] = np.random.default_rng(0).uniform(-BOUND, BOUND, args.m)
            return [client_vector(self.partition_id, bases[args.m])], MAX_WEIGHT, {}

    def client_fn(context):
        return VectorClient(int(context.node_config["partition-id"])).to_client()

    def dropout_mod(msg, context, call_next):
        """Raise (no masked vector) on the collect-masked-vectors stage for the dropped clients."""
        configs = msg.content.config_records.get(RECORD_KEY_CONFIGS)
        if configs is not None and configs.get(Key.STAGE) == Stage.COLLECT_MASKED_VECTORS \
                and dropped(int(context.node_config["partition-id"]), args.n, args.dropout):
            raise RuntimeError("bench dropout: no masked vector")
        return call_next(msg, context)

    def cpu_mod(msg, context, call_next):
        """The ClientApp's CPU seconds for this message, in an extra record of its reply (the workflow
        ignores it; CountingGrid adds them up)."""
        started = time.process_time()
        reply = call_next(msg, context)
        if reply.has_content():
            reply.content.config_records[CPU_RECORD] = ConfigRecord({"s": time.process_time() - started})
        return reply

    client_app = ClientApp(client_fn=client_fn, mods=[cpu_mod, dropout_mod, secaggplus_mod])

    class CountingGrid:
        """The simulation's grid, adding up the clients' CPU seconds from their replies."""

        def __init__(self, grid):
            self._grid = grid

        def __getattr__(self, name):
            return getattr(self._grid, name)

        def send_and_receive(self, messages, *, timeout=None):
            replies = list(self._grid.send_and_receive(messages, timeout=timeout))
            for reply in replies:
                if reply.has_content() and CPU_RECORD in reply.content.config_records:
                    result["client_cpu_s"] = result.get("client_cpu_s", 0.0) \
                        + float(reply.content.config_records[CPU_RECORD]["s"])
            return replies

    class HandOn(FedAvg):
        """The workflow sets every result's parameters to its unmasked aggregate: keep it."""

        def aggregate_fit(self, server_round, results, failures):
            result["aggregate"] = parameters_to_ndarrays(results[0][1].parameters)[0]
            result["results"], result["failures"] = len(results), len(failures)
            return results[0][1].parameters, {}

    secagg = SecAggPlusWorkflow(num_shares=args.num_shares, reconstruction_threshold=args.threshold,
                                clipping_range=BOUND, max_weight=MAX_WEIGHT)
    stage_seconds: dict[str, float] = {}
    for name in ("setup_stage", "share_keys_stage", "collect_masked_vectors_stage", "unmask_stage"):
        stage = getattr(secagg, name)

        def timed_stage(grid, context, state, _stage=stage, _name=name):
            started = time.perf_counter()
            try:
                return _stage(grid, context, state)
            finally:
                stage_seconds[_name] = time.perf_counter() - started
        setattr(secagg, name, timed_stage)

    def timed_fit(grid, context):
        # warm-up: one get_properties to every client (Ray actors started, ClientApp loaded)
        content = compat.getpropertiesins_to_recorddict(GetPropertiesIns({}))
        nodes = list(grid.get_node_ids())
        started = time.perf_counter()
        grid.send_and_receive([Message(content=content, dst_node_id=node, message_type=MessageTypeLegacy.GET_PROPERTIES,
                                       group_id="warm-up") for node in nodes])
        result["warm_up_s"] = time.perf_counter() - started
        started_cpu, started = time.process_time(), time.perf_counter()
        secagg(CountingGrid(grid), context)
        result["round_s"] = time.perf_counter() - started
        result["server_process_cpu_s"] = time.process_time() - started_cpu

    server_app = ServerApp()

    @server_app.main()
    def main(grid, context):
        strategy = HandOn(fraction_fit=1.0, fraction_evaluate=0.0, min_fit_clients=args.n,
                          min_available_clients=args.n,
                          initial_parameters=ndarrays_to_parameters([np.zeros(args.m)]))
        legacy = LegacyContext(context=context, config=ServerConfig(num_rounds=1), strategy=strategy)
        DefaultWorkflow(fit_workflow=timed_fit)(grid, legacy)

    result["stage_s"] = stage_seconds
    return server_app, client_app, result


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--n", type=int, default=100)
    parser.add_argument("--m", type=int, default=10**6)
    parser.add_argument("--num-shares", type=int, required=True,
                        help="SecAgg+ neighbourhood incl. the client itself (fedfleet's degree + 1)")
    parser.add_argument("--threshold", type=int, required=True, help="shares needed to rebuild a secret (t')")
    parser.add_argument("--dropout", type=float, default=0.1)
    parser.add_argument("--cpus", type=int, default=os.cpu_count(), help="CPUs Ray may use")
    parser.add_argument("--parallel", type=int, default=1,
                        help="ClientApps run at once (Ray actors; each gets cpus / parallel CPUs)")
    parser.add_argument("--json-out", type=Path)
    args = parser.parse_args(argv)

    server_app, client_app, result = build(args)
    backend_config = {"init_args": {"num_cpus": args.cpus, "include_dashboard": False, "log_to_driver": False},
                      "client_resources": {"num_cpus": args.cpus / args.parallel, "num_gpus": 0.0}}
    started = time.perf_counter()
    run_simulation(server_app=server_app, client_app=client_app, num_supernodes=args.n,
                   backend_config=backend_config)
    simulation_s = time.perf_counter() - started

    import flwr

    base = np.random.default_rng(0).uniform(-BOUND, BOUND, args.m)
    survivors = [i for i in range(args.n) if not dropped(i, args.n, args.dropout)]
    expected = np.zeros(args.m)
    for i in survivors:
        expected += client_vector(i, base)
    aggregate = result.get("aggregate")
    quantisation_step = 2 * BOUND / SecAggPlusWorkflow(3, 2).quantization_range
    error = float(np.max(np.abs(aggregate * len(survivors) - expected))) if aggregate is not None else float("nan")
    out = {
        "flwr": flwr.__version__, "n": args.n, "m": args.m, "num_shares": args.num_shares,
        "reconstruction_threshold": args.threshold, "dropped": args.n - len(survivors),
        "results": result.get("results"), "failures": result.get("failures"),
        "parallel": args.parallel, "cpus": args.cpus,
        "round_s": result.get("round_s"), "stage_s": result.get("stage_s"),
        "server_process_cpu_s": result.get("server_process_cpu_s"), "client_cpu_s": result.get("client_cpu_s"),
        "warm_up_s": result.get("warm_up_s"), "simulation_s": simulation_s,
        "modulus_bits": int(np.log2(SecAggPlusWorkflow(3, 2).modulus_range)),
        "quantization_bits": int(np.log2(SecAggPlusWorkflow(3, 2).quantization_range)),
        "mask_prg": "numpy RandomState (MT19937) seeded with 32 bits (the XOR of the 32-byte seed's words), "
                    "randint(0, 2^32 - 1) into int64",
        "max_abs_error": error, "tolerance": len(survivors) * quantisation_step,
        "correct": bool(aggregate is not None and error <= len(survivors) * quantisation_step),
    }
    text = json.dumps(out)
    if args.json_out:
        args.json_out.write_text(text)
    print(text)
    return 0 if out["correct"] else 1


if __name__ == "__main__":
    sys.exit(main())
