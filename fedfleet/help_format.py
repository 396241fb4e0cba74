"""The help layout of every fedfleet command."""

from __future__ import annotations

import argparse


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """Every flag's default in its help; descriptions keep their line breaks."""

    def _get_help_string(self, action):
        if action.default is None or action.default is argparse.SUPPRESS or action.default is False:
            return action.help                        # "default: the preset's" is said in the help itself
        return super()._get_help_string(action)
