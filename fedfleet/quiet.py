"""Third-party warnings that say nothing to a fedfleet user, silenced where fedfleet starts.

Each filter names the warning's text and the module (or logger) it comes from, so a new warning
(or these ones from another place) still shows. The environment variable carries the Python
warning filters into the worker and aggregator processes a command starts; those processes
install the logging filters themselves (:func:`quiet_third_party_warnings` in their ``main``).
ExecuTorch's native start-up lines (cpuinfo, threadpool) are caught where the pool is made
(``edge_client.runtime.executorch_runtime.set_executorch_threads``).
"""

from __future__ import annotations

import logging
import os
import re
import warnings

# (category, the message's beginning): what torch/executorch print on every export and load. The
# beginning is a literal with neither ':' nor ',' (PYTHONWARNINGS separators).
FILTERS = (
    (FutureWarning, "`isinstance(treespec"),
)

# (logger, pattern of the formatted message): logged once per process when ExecuTorch's runtime
# is imported (it imports torchao): optional CUDA kernel libraries a CPU build cannot load, no
# Triton on a CPU machine, and torch's deprecation notice for an enum torchao registers.
LOG_FILTERS = (
    ("torchao", r"^Failed to load \S+/torchao/_C\w*[.]\S*so: "),
    ("torchao.kernel.intmm", r"^Warning: Detected no triton"),
    ("torch.utils._pytree", r"^<enum '\w+'> is an Enum subclass and is now natively supported by torch.compile"),
)


class _DropMatching(logging.Filter):
    def __init__(self, pattern: str):
        super().__init__()
        self.pattern = re.compile(pattern)

    def filter(self, record: logging.LogRecord) -> bool:
        return not self.pattern.search(record.getMessage())


def quiet_third_party_warnings() -> None:
    specs = []
    for category, beginning in FILTERS:
        warnings.filterwarnings("ignore", message=re.escape(beginning), category=category)
        specs.append(f"ignore:{beginning}:{category.__name__}")
    inherited = os.environ.get("PYTHONWARNINGS", "")
    os.environ["PYTHONWARNINGS"] = ",".join(filter(None, [inherited, *specs]))
    for name, pattern in LOG_FILTERS:
        logger = logging.getLogger(name)
        if not any(isinstance(f, _DropMatching) and f.pattern.pattern == pattern for f in logger.filters):
            logger.addFilter(_DropMatching(pattern))
