"""ExecuTorch backend (the default): XNNPACK-delegated inference and the head training program.

Programs are loaded from the verified bytes (never re-read from disk). Inference programs
are memory-planned for batches up to ``batch.max``; larger inputs run in slices.

Speed. The XNNPACK delegate runs on ExecuTorch's process-wide threadpool, which is sized
once per process (:func:`set_executorch_threads`; ExecuTorch's default is the number of
performance cores it detects). XNNPACK runs the network one layer at a time over the whole
call, so a call whose activations outgrow the CPU caches spends its time in memory rather
than arithmetic: on a Zen 4 core MobileNetV2 took 7.8 ms per 224 px image in calls of 1-2
rows but 9.9 ms in calls of 32, while 64 px images ran fastest 16 rows at a time. Inference
therefore runs large batches in slices of about :data:`PIXELS_PER_CALL` input pixels per
thread (``rows_per_call`` overrides it); slicing never changes the results.

Training uses ExecuTorch's experimental training extension: ``forward_backward`` runs the
joint program, whose outputs are [loss, logits, gradients..., parameters...]. The parameter
outputs alias the program's mutable weight arena, so writing into them (``set_parameters``)
and the runtime's SGD optimizer stepping them both change what the next call computes. The
training module exposes the parameters only after one call, so loading runs one warm-up
call (whose gradients are discarded).
"""

from __future__ import annotations

import contextlib
import os
import re
import sys
import tempfile
import threading
import warnings

import numpy as np

from edge_client.runtime.base import BatchedInference
from edge_client.runtime.errors import RuntimeUnavailableError
from protocols.bundle_manifest import ArtifactSpec

__all__ = [
    "PIXELS_PER_CALL",
    "ExecuTorchTrainer",
    "ExecuTorchInference",
    "default_rows_per_call",
    "executorch_threads",
    "executorch_version",
    "set_executorch_threads",
]

RUNTIME = "executorch"

# Input pixels per call and thread that keep a mobile CNN's layer-at-a-time activations
# cache-sized: 16 images of 64x64 (see the module docstring for the measurements).
PIXELS_PER_CALL = 16 * 64 * 64


def runtime_bindings():
    """ExecuTorch's C++ runtime bindings (``executorch.extension.pybindings._C``).

    Imported directly: their public wrapper ``portable_lib`` re-exports them, but first imports
    ``executorch.exir`` (the whole export toolchain, which parses an operator YAML in pure Python:
    ~10 s of a 2-core machine per process) for the class of one "experimental API" warning. The
    bindings need only libtorch loaded, which ``import torch`` does. The wrapper stays the fallback
    for an ExecuTorch whose bindings live elsewhere.
    """
    import torch  # noqa: F401  (loads libtorch.so, which the bindings link against)

    try:
        from executorch.extension.pybindings import _C
    except ImportError:
        from executorch.extension.pybindings import portable_lib as _C
    _make_threadpool_once(_C)
    return _C


_threadpool_made = False
_threadpool_lock = threading.Lock()


def _make_threadpool_once(bindings) -> None:
    """Create ExecuTorch's process-wide threadpool here, on one thread holding the GIL, before any
    program runs. Made lazily by the first kernel that asks, it deadlocked a process: two device
    threads running their first programs at once (an emulated host's step threads; seen in the
    suite), one inside the pool's C++ static initialiser logging through the bindings (which
    waits for the GIL), the other holding the GIL while waiting for that initialiser."""
    global _threadpool_made
    if _threadpool_made:
        return
    with _threadpool_lock:
        if not _threadpool_made:
            with _native_stderr_without(NATIVE_STARTUP_LINES):
                bindings._threadpool_get_thread_count()
            _threadpool_made = True


def executorch_version() -> str:
    """Installed ExecuTorch version; RuntimeUnavailableError when it cannot be imported."""
    try:
        from executorch.version import __version__
        runtime_bindings()
    except ImportError as error:
        raise RuntimeUnavailableError(
            f"ExecuTorch is not usable here ({error}); install the `executorch` pip package "
            "(the version the manifest names)") from error
    return __version__


def set_executorch_threads(count: int) -> int:
    """Size ExecuTorch's process-wide threadpool (the one XNNPACK runs on); returns its size.

    Call it before running programs, not while one runs on another thread: ExecuTorch
    replaces the pool rather than resizing it (hence its ``_unsafe_`` name).
    """
    if isinstance(count, bool) or not isinstance(count, int) or count < 1:
        raise ValueError(f"thread count must be a positive integer, got {count!r}")
    executorch_version()
    with _native_stderr_without(NATIVE_STARTUP_LINES):
        runtime_bindings()._unsafe_reset_threadpool(count)
    return executorch_threads()


# What ExecuTorch's C++ runtime prints to stderr (its info level, fixed at build time) when it makes
# its threadpool: cpuinfo probing ARM-only sysfs files and the pool's new size. Nothing to act on.
NATIVE_STARTUP_LINES = re.compile(r"^\[(cpuinfo_utils|threadpool)\.cpp:\d+\] ")


@contextlib.contextmanager
def _native_stderr_without(lines: re.Pattern):
    """Run the block with file descriptor 2 captured, then write back what it printed except the
    lines ``lines`` matches (native code writes to the descriptor, past ``sys.stderr``). Whatever
    another thread printed meanwhile comes out after the block, not lost."""
    if sys.stderr is not None:
        sys.stderr.flush()
    try:
        saved = os.dup(2)
    except OSError:                      # no descriptor 2 at all: nothing will be printed
        yield
        return
    with tempfile.TemporaryFile() as captured:
        os.dup2(captured.fileno(), 2)
        try:
            yield
        finally:
            os.dup2(saved, 2)
            os.close(saved)
            captured.seek(0)
            kept = [line for line in captured.read().splitlines(keepends=True)
                    if not lines.match(line.decode(errors="replace"))]
            if kept:
                os.write(2, b"".join(kept))      # where they were headed, unchanged


def executorch_threads() -> int:
    """Threads in ExecuTorch's threadpool, i.e. what XNNPACK-delegated programs use."""
    executorch_version()
    return runtime_bindings()._threadpool_get_thread_count()


def default_rows_per_call(image_size: int, threads: int) -> int:
    """Rows per inference call for ``image_size`` px inputs: :data:`PIXELS_PER_CALL` per thread."""
    return max(1, PIXELS_PER_CALL * max(1, threads) // (image_size * image_size))


def _check_version(spec: ArtifactSpec) -> None:
    installed = executorch_version()
    if installed != spec.runtime_version:
        warnings.warn(
            f"{spec.file} was exported with ExecuTorch {spec.runtime_version}, running it "
            f"with {installed}; if loading fails install executorch=={spec.runtime_version}",
            RuntimeWarning, stacklevel=3)


def _load_failed(spec: ArtifactSpec, error: Exception) -> RuntimeUnavailableError:
    return RuntimeUnavailableError(
        f"ExecuTorch could not load {spec.file} (exported with ExecuTorch "
        f"{spec.runtime_version}): {error}")


class ExecuTorchInference(BatchedInference):
    """Runs an inference ``.pte``: (N, 3, S, S) float32 -> (N, width) float32.

    ``rows_per_call`` caps the rows handed to the program at once (default:
    :func:`default_rows_per_call` for the threadpool's size when the program is loaded).
    """

    runtime = RUNTIME

    def __init__(self, program: bytes, spec: ArtifactSpec, image_size: int,
                 rows_per_call: int | None = None):
        _check_version(spec)
        _load_program_from_buffer = runtime_bindings()._load_program_from_buffer

        if rows_per_call is not None and (isinstance(rows_per_call, bool) or
                                          not isinstance(rows_per_call, int) or rows_per_call < 1):
            raise ValueError(f"rows_per_call must be a positive integer, got {rows_per_call!r}")
        # The loaded program reads from `program` without copying it: keep the bytes alive.
        self._program = program
        try:
            # The method is loaded once here, not looked up by name on every call; the
            # program object owns it, so it is kept alive too.
            self._loaded_program = _load_program_from_buffer(program)
            self._method = self._loaded_program.load_method(spec.details.get("method", "forward"))
        except RuntimeError as error:
            raise _load_failed(spec, error) from error
        self._spec = spec
        self._image_size = image_size
        self.rows_per_call = rows_per_call or default_rows_per_call(image_size, executorch_threads())
        # One call at a time: a loaded method computes in its memory-planned buffers, so two threads
        # calling it at once overwrote each other's activations and got wrong features back, silently
        # (measured: 39 of 120 calls from 4 threads). A device's deployment follower extracts on its own
        # thread with the extractor its tasks use, and an app embedding the SDK may share one too.
        self._call_lock = threading.Lock()

    def _run_batch(self, x: np.ndarray) -> np.ndarray:
        import torch

        # from_numpy shares x's memory; clone_outputs=False hands back the program's own
        # output buffer, which the next call overwrites, so it is copied exactly once here (under the lock).
        with self._call_lock:
            outputs = self._method.call((torch.from_numpy(x),), clone_outputs=False)
            return outputs[0].numpy().copy()


class ExecuTorchTrainer:
    """One fixed-size batch at a time through the joint forward/backward program."""

    runtime = RUNTIME

    def __init__(self, program: bytes, spec: ArtifactSpec):
        _check_version(spec)
        import torch
        from executorch.extension.training import _load_for_executorch_for_training_from_buffer

        self._program = program  # not copied by the loader: keep the bytes alive
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # "experimental API" notices, once per load
            try:
                self._module = _load_for_executorch_for_training_from_buffer(program)
            except RuntimeError as error:
                raise _load_failed(spec, error) from error
        self._method = spec.details.get("method", "forward")
        self._parameter_names = list(spec.details["trainable_parameters"])
        input_shape = spec.inputs[0].shape    # (B, d) features, or (B, c, h, w) activations
        batch = input_shape[0]
        self._module.forward_backward(self._method, (
            torch.zeros(input_shape), torch.zeros(batch, dtype=torch.int64),
            torch.ones(batch)))
        self._parameters = self._module.named_parameters()
        missing = set(self._parameter_names) - set(self._parameters)
        if missing:
            raise RuntimeUnavailableError(
                f"{spec.file} does not expose trainable parameters {sorted(missing)}")
        self._optimizer = None
        self._optimizer_lr: float | None = None

    def get_parameters(self) -> dict[str, np.ndarray]:
        return {name: self._parameters[name].detach().numpy().copy()
                for name in self._parameter_names}

    def set_parameters(self, values: dict[str, np.ndarray]) -> None:
        import torch

        for name in self._parameter_names:
            self._parameters[name].copy_(torch.from_numpy(values[name]))

    def forward_backward(self, features: np.ndarray, labels: np.ndarray,
                         sample_weight: np.ndarray) -> tuple[float, dict[str, np.ndarray]]:
        import torch

        outputs = self._module.forward_backward(self._method, (
            torch.from_numpy(features), torch.from_numpy(labels),
            torch.from_numpy(sample_weight)))
        gradients = self._module.named_gradients()
        return float(outputs[0]), {name: gradients[name].numpy() for name in self._parameter_names}

    def sgd_step(self, gradients: dict[str, np.ndarray], lr: float) -> None:
        import torch
        from executorch.extension.training import get_sgd_optimizer

        if self._optimizer is None or self._optimizer_lr != lr:
            # The runtime's SGD has no learning-rate setter; a new one is cheap (no state
            # without momentum).
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                self._optimizer = get_sgd_optimizer(self._parameters, lr, 0.0, 0.0, 0.0, False)
            self._optimizer_lr = lr
        self._optimizer.step({name: torch.from_numpy(np.ascontiguousarray(grad))
                              for name, grad in gradients.items()})
