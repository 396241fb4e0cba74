"""Where ``fedfleet device`` keeps its state when ``--state-dir`` does not say: a folder per device
under the XDG state home (``$FEDFLEET_STATE_HOME/<id>``, else ``$XDG_STATE_HOME/fedfleet/devices/<id>``,
else ``~/.local/state/fedfleet/devices/<id>``), created private (0700: the sample-window ledger in it
is privacy state, and the personal parts are the device's own model)."""

from __future__ import annotations

import os
import stat
from collections.abc import Mapping
from pathlib import Path

from protocols.topics import DEVICE_ID_RE

from .errors import UserError

STATE_HOME_ENV = "FEDFLEET_STATE_HOME"      # the folder of every device's folder (tests point it elsewhere)
XDG_STATE_HOME_ENV = "XDG_STATE_HOME"
CHOICES = "give --state-dir DIR (a writable folder) or --no-state (stateful tasks and Fed3R tasks over " \
          "fewer than all its samples are then declined)"


def default_state_dir(device_id: str, environ: Mapping[str, str] | None = None) -> Path:
    """The device's own state folder by default. The id is one path component: a device id may hold
    dots, and "." or ".." would name the folder of every device or the one above it (refused)."""
    environ = os.environ if environ is None else environ
    if not isinstance(device_id, str) or not DEVICE_ID_RE.fullmatch(device_id) or device_id in (".", ".."):
        raise UserError(f"device id {str(device_id)[:80]!r} cannot name a state folder (1-64 of [A-Za-z0-9_.-], "
                        f"not '.' or '..'): {CHOICES}")
    if environ.get(STATE_HOME_ENV):
        if not os.path.isabs(environ[STATE_HOME_ENV]):      # a folder that moved with the working folder
            raise UserError(f"{STATE_HOME_ENV} must be an absolute path, got {environ[STATE_HOME_ENV][:200]!r}")
        return Path(environ[STATE_HOME_ENV]) / device_id
    xdg = environ.get(XDG_STATE_HOME_ENV, "")
    # the XDG base-directory spec: a relative path in the variable is invalid and ignored
    base = Path(xdg) if os.path.isabs(xdg) else _home() / ".local" / "state"
    return base / "fedfleet" / "devices" / device_id


def _home() -> Path:
    try:
        return Path.home()
    except RuntimeError as exc:          # no $HOME and no password entry for the user
        raise UserError(f"no home folder for the device's state ({exc}): {CHOICES}") from None


def make_private_dir(path: Path) -> list[Path]:
    """Create ``path`` and each missing folder above it with mode 0700 (the XDG spec's mode; the
    umask is not consulted). A folder that exists keeps its mode: the operator may have chosen it,
    but not one that another user could write to or replace (``check_private``). Returns the
    folders made here, outermost first (for :func:`remove_made`)."""
    made: list[Path] = []
    try:
        missing = [folder for folder in (path, *path.parents) if not folder.exists()]   # (ENAMETOOLONG)
        for folder in reversed(missing):
            try:
                folder.mkdir(mode=0o700)
            except FileExistsError:         # made by another process meanwhile: its mode stays
                continue
            made.append(folder)
            folder.chmod(0o700)
        if not path.is_dir():
            raise NotADirectoryError(f"{path} is not a folder")
        check_private(path)
    except OSError as exc:      # a read-only home (EROFS), no permission, a file in the way
        remove_made(made)
        raise UserError(f"cannot create the device's state folder {path}: {exc.strerror or exc}; {CHOICES}") \
            from None
    except UserError:           # not private: the device does not start, so it leaves nothing it made
        remove_made(made)
        raise
    return made


def remove_made(made: list[Path]) -> None:
    """Take back the folders :func:`make_private_dir` made (``made``), innermost first, each only
    while it is empty: whatever was written in one stays, with every folder above it."""
    for folder in reversed(made):
        try:
            folder.rmdir()
        except OSError:         # not empty (or gone): it, and those above it, stay
            return


def check_private(path: Path) -> None:
    """Refuse a state folder that someone else could change, as ssh refuses a loose ~/.ssh: the
    folder (symlinks followed) and every folder above it owned by this user or root, none writable
    by group or others, but for one above it with the sticky bit (/tmp), whose entries only their
    owner may rename. A shared FEDFLEET_STATE_HOME=/tmp/fleet made by another user let that user
    swap the device's folder, or its sample-window ledger (privacy state), for one of theirs."""
    real = Path(os.path.realpath(path))
    for folder in (real, *real.parents):
        st = folder.stat()
        if st.st_uid not in (0, os.geteuid()):
            why = f"{folder} belongs to another user (uid {st.st_uid}; chown it, or choose another folder)"
        elif st.st_mode & 0o022 and (folder == real or not st.st_mode & stat.S_ISVTX):
            why = f"{folder} is writable by {'its group' if st.st_mode & 0o020 else 'others'} (chmod go-w it)"
        else:
            continue
        raise UserError(f"the device's state folder {path} is not private: {why}; {CHOICES}")
