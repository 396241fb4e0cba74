"""Golden training vectors: signed ``fedavg.head`` tasks with a local rule (FedSAM; FedASAM with
FedProx), their features and the head the Python device trains from them, on disk in
``protocols/golden/training/`` so a device in another language (the Java library's
``HeadTrainer``, tests/test_java_fedavg_head.py) proves its SAM step without running Python.

The wire vectors (``protocols/golden.py``) cannot hold these: the expected head is the Python
device's own training (``NumpyHeadStepper``, what a torch-free device runs, bit-reproducible on any
install), and ``protocols`` imports no device code. Regenerate (when the recipe's meaning or the
device's step changes) with ``python -m edge_client.golden_training``; a test checks the files are
what this module produces now.

Files: ``index.json`` ({name: task file, features file, the aggregator's public key, the expected
``weight``/``bias`` as float32 values written as JSON numbers, ``steps``, ``loss``}), one
``<name>.bin`` per signed task, and ``features.feat`` (the FeatureFile format of the Java device:
int32 n, int32 d, n·d float32, n int32 labels, little-endian).

Stateful head tasks (``scaffold.head``, ``ditto.head``, ``pp.head`` FedSim and FedAlt): two
signed rounds of one job per case, run through the Python device's handler with its
:class:`~edge_client.state.DeviceStateStore` (round 1 from an empty store, round 2 continuing
from round 1's state), so another device proves its upload *and* the state it keeps.
``stateful.json``: {case: {kind, public_key, features, heldout, steps per round, rounds: [{task
file, body, tensors (float32 values as JSON numbers), state (the store's arrays after the round)}]}},
the tasks ``<case>_r<round>.bin`` and the held-out features ``heldout.feat``.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

import numpy as np

from protocols.envelope import Envelope, encode
from protocols.golden import GOLDEN_SIGNING_SEED, golden_dir
from protocols.identity import DeviceIdentity

from .state import DeviceStateStore
from .tasks.ditto_training import DittoTrainingTask
from .tasks.head_training import LocalTraining, local_sgd
from .tasks.numpy_head import NumpyHeadStepper
from .tasks.partial_training import PartialTrainingTask
from .tasks.scaffold_training import ScaffoldTrainingTask

FEATURES_FILE = "features.feat"
HELDOUT_FILE = "heldout.feat"
STATEFUL_INDEX = "stateful.json"
C, D, N = 4, 6, 37
RECIPE = {"num_classes": C, "feature_dim": D, "backbone": "b", "image_size": 8, "weights_sha256": "",
          "epochs": 3, "batch_size": 8, "lr": 0.05, "weight_decay": 4e-5, "temperature": 0.1, "seed": 11}
RULES = {"task_fedavg_head_sam": {"local_rule": "sam", "sam_rho": 0.2},
         "task_fedavg_head_asam_prox": {"local_rule": "asam", "sam_rho": 0.5, "asam_eta": 0.2, "prox_mu": 0.1}}
_TS = 1767225600.0            # 2026-01-01T00:00:00Z, as protocols/golden.py
_DEADLINE = 4102444800.0      # 2100-01-01: a device checking deadlines still runs the vector


def training_dir() -> Path:
    return golden_dir() / "training"


def aggregator_identity() -> DeviceIdentity:
    """The vectors' signer: the golden seed, as the aggregator."""
    return DeviceIdentity.from_private_bytes("aggregator", GOLDEN_SIGNING_SEED)


def features() -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(900)
    y = rng.integers(0, C, N)
    return (rng.normal(size=(N, D)) + 2 * np.eye(C, D)[y]).astype(np.float32), y


def start_head() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(3)
    return {"weight": (rng.normal(size=(C, D)) * 0.1).astype(np.float32), "bias": rng.normal(size=C).astype(np.float32)}


def feature_bytes(Z: np.ndarray, y: np.ndarray) -> bytes:
    return struct.pack("<ii", *Z.shape) + np.asarray(Z, "<f4").tobytes() + np.asarray(y, "<i4").tobytes()


def training_vectors() -> tuple[dict, dict[str, bytes]]:
    """(index.json's content, {file name: bytes})."""
    Z, y = features()
    head = start_head()
    signer = aggregator_identity()
    index, files = {}, {FEATURES_FILE: feature_bytes(Z, y)}
    for i, (name, rule) in enumerate(RULES.items()):
        params = {**RECIPE, **rule}
        task = Envelope("task", "aggregator", id=f"{0xd0 + i:02x}" * 16, ts=_TS, tensors=head,
                        body={"job": "sam-golden", "round": 1, "kind": "fedavg.head", "deadline": _DEADLINE,
                              "params": params})
        files[f"{name}.bin"] = encode(task, signer=signer.sign)
        stepper = NumpyHeadStepper(head["weight"], head["bias"], LocalTraining.from_params(params))
        steps, loss = local_sgd(stepper, len(y), Z, y, LocalTraining.from_params(params))
        trained = stepper.parameters()
        index[name] = {"task": f"{name}.bin", "features": FEATURES_FILE, "public_key": signer.public_key_bytes.hex(),
                       "params": params, "steps": steps, "loss": loss,
                       "weight": np.asarray(trained["weight"], np.float32).tolist(),
                       "bias": np.asarray(trained["bias"], np.float32).tolist()}
    return index, files


# ----------------------------------------------------------------------------- stateful head tasks
RUN = "5eed0123"
# a milder temperature than the FedSAM vectors': the float32 tolerance grows with (F/T)², and two
# rounds (with Ditto's and FedAlt's second pass) take three to four times their steps
STATEFUL_RECIPE = {**RECIPE, "temperature": 0.5, "lr": 0.1}
STATEFUL = {   # case -> (kind, its params beyond RECIPE and the binding, its handler)
    "scaffold_head": ("scaffold.head", {}, ScaffoldTrainingTask),
    "ditto_head": ("ditto.head", {"local_rule": "sam", "sam_rho": 0.2, "ditto_lambda": 0.5, "personal_epochs": 2,
                                  "personal_lr": 0.03}, DittoTrainingTask),
    "pp_head_fedalt": ("pp.head", {"algorithm": "fedalt", "personal_epochs": 2}, PartialTrainingTask),
    "pp_head_fedsim": ("pp.head", {"algorithm": "fedsim"}, PartialTrainingTask),
    # its second task comes 7 rounds later, past max_staleness 5: c_k restarts from 0 and Δc is
    # measured from the stale c_k the server's c still counts
    "scaffold_head_stale": ("scaffold.head", {}, ScaffoldTrainingTask),
}
STATEFUL_ROUNDS = {"scaffold_head_stale": (1, 8)}      # a case's two rounds (default 1 and 2)


class _GivenFeatures:
    """The backbone of the vectors: the device's 'images' already are its features."""

    def __init__(self, dim: int):
        self.feature_dim = dim

    def extract(self, x):
        return np.asarray(x, dtype=np.float32)


def heldout_features() -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(901)
    y = rng.integers(0, C, 23)
    return (rng.normal(size=(len(y), D)) + 2 * np.eye(C, D)[y]).astype(np.float32), y


def round_tensors(kind: str, round_: int) -> dict[str, np.ndarray]:
    """The task's tensors of a round: the global head (moved a little each round) and, for
    Scaffold, a server control c."""
    rng = np.random.default_rng(40 + round_)
    head = {k: (v + rng.normal(size=v.shape) * 0.05).astype(np.float32) for k, v in start_head().items()}
    if kind == "scaffold.head":
        head.update({f"control.{k}": (rng.normal(size=v.shape) * 0.3).astype(np.float32) for k, v in head.items()})
    return head


def _floats(arrays: dict[str, np.ndarray]) -> dict[str, list]:
    return {k: np.asarray(v, np.float32).tolist() for k, v in sorted(arrays.items())}


def stateful_vectors(workdir: Path) -> tuple[dict, dict[str, bytes]]:
    """(stateful.json's content, {file name: bytes}); ``workdir``: where the Python device keeps its state."""
    Z, y = features()
    Zh, yh = heldout_features()
    signer = aggregator_identity()
    index, files = {}, {HELDOUT_FILE: feature_bytes(Zh, yh)}
    for i, (case, (kind, extra, handler_type)) in enumerate(STATEFUL.items()):
        store = DeviceStateStore(workdir / case, clock=lambda: _TS)
        handler = handler_type(Z, y, lambda b, s, w: _GivenFeatures(D), store, Zh, yh) \
            if handler_type is not ScaffoldTrainingTask else handler_type(Z, y, lambda b, s, w: _GivenFeatures(D), store)
        rounds, job_id = [], f"{case}-golden"
        for r in STATEFUL_ROUNDS.get(case, (1, 2)):
            params = {**STATEFUL_RECIPE, **extra, "job_id": job_id, "state": {"run": RUN, "round": r,
                                                                       "max_staleness": 5, "ttl_s": 3600.0}}
            tensors = round_tensors(kind, r)
            task = Envelope("task", "aggregator", id=f"{0xe0 + 2 * i + r:02x}" * 16, ts=_TS, tensors=tensors,
                            body={"job": f"{case}-golden", "round": r, "kind": kind, "deadline": _DEADLINE,
                                  "params": params})
            files[f"{case}_r{r}.bin"] = encode(task, signer=signer.sign)
            body, out = handler(params, tensors)
            entry = store.load(job_id, RUN)
            rounds.append({"task": f"{case}_r{r}.bin", "params": params, "body": body, "tensors": _floats(out),
                           "state": _floats(entry.arrays)})
        index[case] = {"kind": kind, "features": FEATURES_FILE, "heldout": HELDOUT_FILE,
                       "public_key": signer.public_key_bytes.hex(), "rounds": rounds}
    return index, files


def write(directory: Path | None = None) -> None:
    import tempfile

    directory = directory or training_dir()
    directory.mkdir(parents=True, exist_ok=True)
    index, files = training_vectors()
    with tempfile.TemporaryDirectory() as work:
        stateful, more = stateful_vectors(Path(work))
    for name, data in {**files, **more}.items():
        (directory / name).write_bytes(data)
    (directory / "index.json").write_text(json.dumps(index, indent=1, sort_keys=True))
    (directory / STATEFUL_INDEX).write_text(json.dumps(stateful, indent=1, sort_keys=True))


if __name__ == "__main__":
    write()
    print(f"wrote training vectors to {training_dir()}")
