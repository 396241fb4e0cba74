"""SecAgg messages in their wire form: a round trip keeps signatures, and malformed headers, arrays
and structured fields (a config bound that would overflow, short keys, a duplicate sender) raise
MalformedMessage."""

import base64

import numpy as np
import pytest

from protocols.secagg import (AdvertiseKeys, ForwardedShares, KeyDirectory, MalformedMessage, MaskedInput, RoundStart,
                              decode)

from secagg_rounds import Round


def _wire_of_masked_input():
    r = Round(n=5, m=40)
    r.step()
    r.step()
    return r.to_clients()[0].to_wire()


def test_round_trip_through_the_wire_form_preserves_signatures():
    header, arrays = _wire_of_masked_input()
    message = decode(header, arrays)
    assert isinstance(message, MaskedInput)
    assert message.canonical_bytes() == decode(*message.to_wire()).canonical_bytes()


@pytest.mark.parametrize("mutation", ["type", "missing", "extra", "dtype", "rank", "base64", "round_str",
                                      "round_negative", "extra_array", "not_a_list"])
def test_malformed_wire_forms_raise_malformed_message(mutation):
    header, arrays = _wire_of_masked_input()
    header, arrays = dict(header), dict(arrays)
    if mutation == "type":
        header["type"] = "secagg.nope"
    elif mutation == "missing":
        del header["group_id"]
    elif mutation == "extra":
        header["surprise"] = 1
    elif mutation == "dtype":
        arrays["masked_input"] = arrays["masked_input"].astype(np.float64)
    elif mutation == "rank":
        arrays["masked_input"] = arrays["masked_input"].reshape(4, 10)
    elif mutation == "base64":
        header["signature"] = "***"
    elif mutation == "round_str":
        header["round_id"] = "3"
    elif mutation == "round_negative":
        header["round_id"] = -1
    elif mutation == "extra_array":
        arrays["more"] = np.zeros(2, np.uint8)
    elif mutation == "not_a_list":
        header = ["not", "a", "mapping"]
    with pytest.raises(MalformedMessage):
        decode(header, arrays)


def _pending_wire_after(steps):
    r = Round(n=5)
    for _ in range(steps):
        r.step()
    return r.pending[0].to_wire()


def _short_neighbour_keys(header):
    return [[e[0], e[1], base64.b64encode(b"x").decode(), e[3], e[4]] for e in header["neighbour_keys"]]


@pytest.mark.parametrize("steps, kind, corrupt", [
    (0, RoundStart, lambda h, a: ({**h, "config": {**h["config"], "bound": 2.0**70}}, a)),  # would overflow
    (1, KeyDirectory, lambda h, a: (h, {**a, "identity_keys": a["identity_keys"][:, :-1]})),
    (1, KeyDirectory, lambda h, a: ({**h, "neighbour_keys": _short_neighbour_keys(h)}, a)),
    (2, ForwardedShares, lambda h, a: ({**h, "senders": h["senders"] + h["senders"][:1]}, a)),  # duplicate sender
], ids=["config_bound", "identity_key_width", "short_neighbour_key", "duplicate_sender"])
def test_malformed_structured_fields(steps, kind, corrupt):
    header, arrays = _pending_wire_after(steps)
    assert isinstance(decode(header, arrays), kind)      # the message as sent is accepted
    with pytest.raises(MalformedMessage):
        decode(*corrupt(header, arrays))


def test_round_start_and_advertise_are_wire_stable():
    r = Round(n=5)
    start = r.pending[0]
    again = decode(*start.to_wire())
    assert isinstance(again, RoundStart) and again.config == start.config
    advert = r.to_clients([start])[0]
    assert isinstance(advert, AdvertiseKeys)
    again = decode(*advert.to_wire())
    assert again.signature == advert.signature and again.mask_public_key == advert.mask_public_key
