"""A LADD job's phases and the events that move them; the rules are ``LADD_TABLE`` in
``aggregator/jobs/ladd.py``, next to the job whose methods are its guards and effects."""

from __future__ import annotations

import enum
from dataclasses import dataclass


class LaddPhase(enum.StrEnum):
    """A LADD job's phase. A StrEnum: checkpoints, bookkeeping and reports hold its text."""
    STYLES = "styles"       # asking devices for their styles
    TRAIN = "train"         # clustered and pre-trained: training rounds (late devices still send styles)
    DONE = "done"           # the last training round closed (``rounds`` run, or the privacy budget spent)


# -- events: where the job's phase may change (the job holds what they need; ``entry``: the round log's)
@dataclass(frozen=True)
class Created:
    """The job was built."""


@dataclass(frozen=True)
class NobodyLeftToAsk:
    """Scheduling found no online device left to ask for its style."""


@dataclass(frozen=True)
class StyleRoundClosed:
    entry: dict


@dataclass(frozen=True)
class TrainRoundClosed:
    entry: dict
