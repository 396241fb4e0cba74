"""The server's view of a backbone tail: the bundle's ``tail_eval.pt2`` (FT(φ) / FT(M) jobs).

A FedAvg job that fine-tunes the backbone's last stages (``fedavg.tail``) must send devices
the initial tail and evaluate the global model, yet the aggregator never imports device code
(``edge_client``). The export step therefore ships, next to the devices' programs, a
``torch.export`` program of ``logits = head(tail(activations))`` whose parameters carry the
wire names (``tail.<...>``, ``weight``, ``bias``). The aggregator loads it with
``torch.export.load`` (a serialised graph, not pickled code), reads the pretrained tail
from it, and evaluates any global model by passing that model's tensors by name
(``torch.func.functional_call``), on the GPU when there is one.
"""

from __future__ import annotations

import hashlib
import io
from pathlib import Path

import numpy as np

from aggregator.compute.device import pick_device
from aggregator.jobs.input_files import read_job_input

# torch is imported where it is used, not here: the job registry imports this module, and a
# command that only checks a config (or prints its help) must not pay torch's import (~1.3 s).

EVAL_BATCH = 4096


class TailProgramError(ValueError):
    """The tail program file is missing, tampered with, or not a tail evaluation program."""


class TailProgram:
    def __init__(self, path: str | Path, expected_sha256: str = "", device: str = "auto"):
        import torch

        try:
            data = read_job_input(path, "tail program")
        except (OSError, ValueError) as exc:
            raise TailProgramError(f"cannot read the tail program {path}: {exc}") from exc
        digest = hashlib.sha256(data).hexdigest()
        if expected_sha256 and digest != expected_sha256:
            raise TailProgramError(f"{path}: sha256 {digest} differs from the expected {expected_sha256}")
        try:
            exported = torch.export.load(io.BytesIO(data))
        except Exception as exc:     # torch raises assorted types for a foreign or damaged file
            raise TailProgramError(f"{path} is not a torch.export program: {exc}") from exc
        inputs = [node for node in exported.graph.nodes if node.op == "placeholder"
                  and node.name in exported.graph_signature.user_inputs]
        if len(inputs) != 1 or "val" not in inputs[0].meta or inputs[0].meta["val"].dim() != 4:
            raise TailProgramError(f"{path}: expected one (batch, c, h, w) activations input")
        self.sha256 = digest
        self.activation_shape = tuple(int(s) for s in inputs[0].meta["val"].shape[1:])
        self.device = pick_device(device)
        self._module = exported.module().to(self.device)
        self.initial = {name: param.detach().cpu().numpy().copy()
                        for name, param in self._module.named_parameters()}
        if not {"weight", "bias"} <= set(self.initial) or not any(n.startswith("tail.") for n in self.initial):
            raise TailProgramError(f"{path}: parameters {sorted(self.initial)} are not tail.* + weight + bias")

    @property
    def tail_parameters(self) -> dict[str, np.ndarray]:
        return {name: value.copy() for name, value in self.initial.items() if name.startswith("tail.")}

    def shapes(self) -> dict[str, tuple[int, ...]]:
        return {name: value.shape for name, value in self.initial.items()}

    def logits(self, params: dict[str, np.ndarray], activations: np.ndarray) -> np.ndarray:
        """(n, C) logits of the model ``params`` (every name of :meth:`shapes`) on (n, c, h, w)
        activations, or on their rows flattened to (n, c·h·w)."""
        import torch

        if set(params) != set(self.initial):
            raise ValueError(f"model tensors {sorted(params)} differ from the program's {sorted(self.initial)}")
        activations = np.asarray(activations, dtype=np.float32).reshape(-1, *self.activation_shape)
        tensors = {name: torch.from_numpy(np.ascontiguousarray(value, dtype=np.float32)).to(self.device)
                   for name, value in params.items()}
        out = []
        with torch.no_grad():
            for start in range(0, len(activations), EVAL_BATCH):
                batch = torch.from_numpy(activations[start:start + EVAL_BATCH]).to(self.device)
                out.append(torch.func.functional_call(self._module, tensors, (batch,)).cpu().numpy())
        return np.concatenate(out) if out else np.zeros((0, len(params["bias"])), np.float32)

    def accuracy(self, params: dict[str, np.ndarray], activations: np.ndarray, labels: np.ndarray) -> float:
        labels = np.asarray(labels)
        if len(labels) == 0:
            raise ValueError("no evaluation samples")
        return float((self.logits(params, activations).argmax(axis=1) == labels).mean())
