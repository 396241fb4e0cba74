"""A ``python -m`` entry module for tests/test_fork_server.py: does what argv[0] says, writes
what it saw (argv, cwd, an environment variable) to argv[1] as JSON first."""

from __future__ import annotations

import atexit
import json
import os
import sys
import threading
import time
from pathlib import Path


def main(argv: list[str]) -> int:
    action, report = argv[0], Path(argv[1])
    report.write_text(json.dumps({"argv": argv, "sys_argv_tail": sys.argv[1:], "cwd": os.getcwd(),
                                  "probe": os.environ.get("PROBE"), "pid": os.getpid(),
                                  "torch_imported": "torch" in sys.modules}))
    print(f"probe {action} on stdout")
    print(f"probe {action} on stderr", file=sys.stderr)
    if action == "exit":
        return int(argv[2])
    if action == "sys-exit-message":
        sys.exit("a message instead of a status")
    if action == "raise":
        raise RuntimeError("probe failure")
    if action == "raise-quoting":    # as an entry module: its logging set up, then an error quoting argv[2]
        from protocols.log_text import log_to_stderr

        log_to_stderr()
        raise RuntimeError(argv[2])
    if action == "late-thread":      # a non-daemon thread and an atexit handler outlive main()
        threading.Thread(target=lambda: (time.sleep(0.3), print("thread finished"))).start()
        atexit.register(lambda: print("atexit ran"))
        return 0
    if action == "wait":
        time.sleep(120)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
