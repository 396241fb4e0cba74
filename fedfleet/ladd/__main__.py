"""``python -m fedfleet.ladd``: the LADD comparison from the command line."""

import sys

from fedfleet.ladd.cli import main

sys.exit(main())
