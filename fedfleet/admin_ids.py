"""The ids the admin commands put into the API's paths and queries (jobs, devices, deployments),
checked before a request is built: unchecked, ``fedfleet admin job pause 'ops/cancel?x='`` sent
``POST /api/jobs/ops/cancel`` — another action on the job — and printed that it paused it."""

from __future__ import annotations

import re

# the API's id characters; "." and ".." name no resource (a client normalising the path drops them)
API_ID = re.compile(r"^(?!\.{1,2}$)[A-Za-z0-9_.-]{1,64}$")
# the parsed arguments that name a device, a job or a deployment ("" or None: not given)
ID_ARGUMENTS = ("device_id", "job_id", "deployment_id", "job", "deployment")


def refused_id(args) -> str | None:
    """Why one of the ids in ``args`` cannot be sent (one line), or None when all can."""
    for name in ID_ARGUMENTS:
        value = getattr(args, name, None)
        if isinstance(value, str) and value and not API_ID.fullmatch(value):
            return (f"{value[:80]!r} is not an id ({name}): 1 to 64 letters, digits, '_', '.' or '-', "
                    "not '.' or '..'")
    return None
