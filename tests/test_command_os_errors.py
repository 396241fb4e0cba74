"""An OSError that names its file (a read-only file system, a full disk) is a user's to mend: one
line naming the file and the reason, exit 2 (``protocols/command_errors.py``); one that names no
file is still a traceback, as any error the user did not cause. A review found ``fedfleet device
--credentials`` beside a read-only folder (it writes the key files there) ended in a traceback."""

import errno
import os

import pytest

from protocols.command_errors import run_reporting_errors


@pytest.mark.parametrize("code", [errno.EROFS, errno.ENOSPC, errno.ENAMETOOLONG, errno.EIO])
def test_an_os_error_naming_its_file_is_one_line(code, capsys):
    def fails():
        raise OSError(code, os.strerror(code), "/etc/fleet/cam1.key.pem")

    assert run_reporting_errors("device", fails, debug=False) == 2
    err = capsys.readouterr().err.splitlines()
    assert err == [f"fedfleet device: error: {os.strerror(code)}: /etc/fleet/cam1.key.pem"]


def test_an_os_error_naming_no_file_or_under_debug_is_raised():
    def fails():
        raise OSError(errno.EIO, os.strerror(errno.EIO))

    with pytest.raises(OSError):
        run_reporting_errors("device", fails, debug=False)
    with pytest.raises(OSError):
        run_reporting_errors("device", lambda: (_ for _ in ()).throw(OSError(errno.EROFS, "ro", "/x")), debug=True)
