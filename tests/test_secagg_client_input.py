"""A SecAgg client's own input: NaN, out-of-bound or misshapen vectors are an InputError with nothing
sent, and the input is required before masking and frozen after."""

import numpy as np
import pytest

from protocols.secagg import ClientState, InputError, MaskedInput

from secagg_rounds import BOUND, Round


@pytest.mark.parametrize("bad", [np.full(40, np.nan), np.full(40, BOUND * 1.01), np.zeros(41), np.zeros((40, 1))])
def test_bad_client_input_is_an_input_error_and_nothing_is_sent(bad):
    r = Round(n=5, m=40)
    start = r.pending[0]
    client = r.clients[start.recipient]
    client.handle(start)
    with pytest.raises(InputError):
        client.provide_input(bad)
    client.provide_input(r.inputs[start.recipient])  # a good input is still accepted


def test_input_is_required_before_masking_and_frozen_after():
    r = Round(n=5, m=40, withhold=("device-0",))
    r.step()
    r.step()
    forwarded = next(m for m in r.pending if m.recipient == "device-0")
    client = r.clients["device-0"]
    with pytest.raises(InputError):
        client.handle(forwarded)
    assert client.state is ClientState.SHARES_SENT
    client.provide_input(r.inputs["device-0"])
    assert isinstance(client.handle(forwarded)[0], MaskedInput)
    with pytest.raises(InputError):
        client.provide_input(r.inputs["device-0"])
