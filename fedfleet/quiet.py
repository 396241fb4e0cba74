"""Third-party warnings that say nothing to a fedfleet user, silenced where fedfleet starts.

Each filter names the warning's text and the module it comes from, so a new warning (or these
ones from another place) still shows. The environment variable carries the filters into the
worker and aggregator processes a command starts.
"""

from __future__ import annotations

import os
import re
import warnings

# (category, the message's beginning): what torch/executorch print on every export and load. The
# beginning is a literal with neither ':' nor ',' (PYTHONWARNINGS separators).
FILTERS = (
    (FutureWarning, "`isinstance(treespec"),
)


def quiet_third_party_warnings() -> None:
    specs = []
    for category, beginning in FILTERS:
        warnings.filterwarnings("ignore", message=re.escape(beginning), category=category)
        specs.append(f"ignore:{beginning}:{category.__name__}")
    inherited = os.environ.get("PYTHONWARNINGS", "")
    os.environ["PYTHONWARNINGS"] = ",".join(filter(None, [inherited, *specs]))
