"""fedfleet.quiet and the ExecuTorch runtime's start-up: the known third-party notices (torchao's
CUDA libraries, no Triton, torch's enum deprecation, ExecuTorch's native cpuinfo/threadpool lines)
are gone from a process's stderr, while any other line from the same sources still shows."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

CODE = """
import logging, os
logging.basicConfig(level=logging.WARNING, format="%(name)s %(message)s")
from fedfleet.quiet import quiet_third_party_warnings
quiet_third_party_warnings()
from edge_client.runtime.executorch_runtime import NATIVE_STARTUP_LINES, _native_stderr_without, set_executorch_threads
set_executorch_threads(1)             # ExecuTorch's native cpuinfo and threadpool lines
import torchao                        # its CUDA-library, Triton and enum-registration notices
logging.getLogger("torchao").warning("Failed to load a config file")
with _native_stderr_without(NATIVE_STARTUP_LINES):
    os.write(2, b"[threadpool.cpp:66] Resetting threadpool to 1 threads.\\nnative news\\n")
print("done")
"""


def test_known_start_up_notices_are_silenced_and_other_lines_still_show():
    out = subprocess.run([sys.executable, "-c", CODE], capture_output=True, text=True, cwd=ROOT, timeout=300,
                         env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1"})
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "done"
    assert out.stderr.splitlines() == ["torchao Failed to load a config file", "native news"], out.stderr
