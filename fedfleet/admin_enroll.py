"""Where ``fedfleet admin device enroll --out FILE`` writes the one-time credentials.

They are shown once: the aggregator keeps only their hashes, and enrolling the id again is refused
until it is revoked. So the target is checked before anything is enrolled (a missing folder lost
an enrolment's credentials after it was committed), and should the write still fail afterwards the
error says how to recover. The file is written under a temp name and renamed over ``FILE``
(``write_private_file``): a link planted there is replaced, never followed, and an existing file
is replaced whole (the CLI's convention).
"""

from __future__ import annotations

import json
from pathlib import Path

from protocols.files import check_new_file_target, write_private_file


def check_credentials_target(out: Path | None) -> None:
    """OSError naming ``out`` unless the credentials can be written there (nothing to check without it)."""
    if out is not None:
        check_new_file_target(out)


def write_credentials(out: Path, creds: dict, device_id: str) -> None:
    """``creds`` written to ``out``, owner-only; a failure (the folder went meanwhile, a full disk)
    is one OSError that says the device is enrolled and how to get new credentials."""
    try:
        write_private_file(out, json.dumps(creds, indent=1).encode())
    except OSError as exc:
        raise OSError(f"{device_id} is enrolled, but its credentials could not be written to {out} "
                      f"({exc.strerror or exc}) and are lost (the aggregator keeps only their hashes): revoke it "
                      f"(fedfleet admin device revoke {device_id}) and enrol it again") from None
