"""The help layout of every fedfleet command (``fedfleet``'s own and ``fedfleet aggregator``'s), and
the argument types they share."""

from __future__ import annotations

import argparse


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """Every flag's default in its help; descriptions keep their line breaks. A help that says its
    default itself, or a default of nothing (None, False, "", an empty list), gets none added
    ("(default: unsigned, development) (default: None)" said it twice)."""

    def _get_help_string(self, action):
        default = action.default
        if (default is None or default is argparse.SUPPRESS or default is False
                or (isinstance(default, (str, tuple, list)) and not default) or "default" in (action.help or "")):
            return action.help
        return super()._get_help_string(action)


def positive_int(text: str) -> int:
    """argparse's type of a count: a whole number of at least 1, else one line saying so (a bad
    argument, exit 2, found before any work starts)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} is not at least 1")
    return value
