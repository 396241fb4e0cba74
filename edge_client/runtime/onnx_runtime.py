"""ONNX Runtime backend: inference only (ORT's training packages are no longer published).

The session is built from the verified bytes, on the CPU execution provider, with the
thread count left to ORT unless the caller asks for one (per session, or for the whole process
with :func:`set_onnxruntime_threads`, as ``fedfleet device --threads`` does).
"""

from __future__ import annotations

import numpy as np

from edge_client.runtime.base import BatchedInference
from edge_client.runtime.errors import RuntimeUnavailableError
from protocols.bundle_manifest import ArtifactSpec

__all__ = ["OnnxRuntimeInference", "onnxruntime_version", "set_onnxruntime_threads"]

RUNTIME = "onnxruntime"

_default_threads: int | None = None      # intra-op threads of sessions that name none (None: ORT's choice)


def set_onnxruntime_threads(count: int) -> None:
    """Intra-op threads of every ONNX Runtime session made afterwards without an explicit count."""
    global _default_threads
    if isinstance(count, bool) or not isinstance(count, int) or count < 1:
        raise ValueError(f"thread count must be a positive integer, got {count!r}")
    _default_threads = count


def onnxruntime_version() -> str:
    try:
        import onnxruntime
    except ImportError as error:
        raise RuntimeUnavailableError(
            f"ONNX Runtime is not installed ({error}); install it with `pip install onnxruntime`"
        ) from error
    return onnxruntime.__version__


class OnnxRuntimeInference(BatchedInference):
    """Runs an inference ``.onnx``: (N, 3, S, S) float32 -> (N, width) float32."""

    runtime = RUNTIME

    def __init__(self, model: bytes, spec: ArtifactSpec, image_size: int,
                 intra_op_threads: int | None = None):
        onnxruntime_version()
        import onnxruntime

        options = onnxruntime.SessionOptions()
        intra_op_threads = _default_threads if intra_op_threads is None else intra_op_threads
        if intra_op_threads is not None:
            options.intra_op_num_threads = intra_op_threads
        try:
            self._session = onnxruntime.InferenceSession(
                model, sess_options=options, providers=["CPUExecutionProvider"])
        except Exception as error:  # ORT raises its own exception types (Fail, InvalidGraph, ...)
            raise RuntimeUnavailableError(
                f"ONNX Runtime {onnxruntime.__version__} could not load {spec.file} "
                f"(exported and checked with {spec.runtime_version}): {error}") from error
        self._input_name = spec.inputs[0].name
        self._spec = spec
        self._image_size = image_size

    @property
    def intra_op_threads(self) -> int:
        """The session's intra-op thread count (0: left to ORT, one per physical core)."""
        return self._session.get_session_options().intra_op_num_threads

    def _run_batch(self, x: np.ndarray) -> np.ndarray:
        return self._session.run(None, {self._input_name: x})[0]
