"""Third-party warnings that say nothing to a fedfleet user, silenced where fedfleet starts.

Each filter names the warning's text and the module it comes from, so a new warning (or these
ones from another place) still shows. The environment variable carries the filters into the
worker and aggregator processes a command starts.
"""

from __future__ import annotations

import os
import warnings

# (category, message regex, module regex): what torch/executorch print on every export and load
FILTERS = (
    (FutureWarning, r".*isinstance\(treespec, LeafSpec\).*", r".*"),
)


def quiet_third_party_warnings() -> None:
    specs = []
    for category, message, module in FILTERS:
        warnings.filterwarnings("ignore", message=message, category=category, module=module)
        specs.append(f"ignore:{message}:{category.__name__}")
    inherited = os.environ.get("PYTHONWARNINGS", "")
    os.environ["PYTHONWARNINGS"] = ",".join(filter(None, [inherited, *specs]))
