"""The Java device's encoder refuses a message no receiver takes, as the Python device's does: over
MAX_MESSAGE_BYTES (512 MiB reassembled) ``protocols.envelope.encode`` raises, and so does
``Envelope.encode`` in clients/java (tests/java_device/EncodeLimit), before it copies the payload.
Before, the Java device encoded such a message whole (three copies of it in memory), chunked it and
sent it, for the aggregator to drop it unread."""

from __future__ import annotations

import subprocess

import numpy as np
import pytest

import java_build
from protocols import messages as M
from protocols.envelope import MAX_MESSAGE_BYTES, EnvelopeError, encode

pytestmark = pytest.mark.skipif(java_build.missing() is not None, reason=str(java_build.missing()))


def java_encodes(*sizes: int) -> str:
    out = subprocess.run(java_build.java_command("-cp", java_build.built(), "EncodeLimit", *map(str, sizes)),
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    return out.stdout.strip()


def python_encodes(*sizes: int) -> str:
    tensors = {f"t{k}": np.zeros(n, np.uint8) for k, n in enumerate(sizes)}
    msg = M.result_message("dev", M.TaskRef("j", 1, "t"), "fed3r.stats", {}, tensors)
    try:
        return f"OK {len(encode(msg))}"
    except EnvelopeError as exc:
        return f"REFUSED {exc}"


# the second: its tensors 7 bytes short of the limit, so the prefix (8 bytes) and header take it past
@pytest.mark.parametrize("sizes, refused", [((1000, 24), False), ((MAX_MESSAGE_BYTES // 2, MAX_MESSAGE_BYTES // 2 - 7), True)],
                         ids=["small", "over-the-limit"])
def test_the_java_encoder_refuses_what_the_python_one_refuses(sizes, refused):
    java, python = java_encodes(*sizes), python_encodes(*sizes)
    assert python.startswith("REFUSED message too large" if refused else "OK"), python
    assert java.startswith("REFUSED message too large" if refused else "OK"), java
    if not refused:
        assert int(java.split()[1]) > sum(sizes)
