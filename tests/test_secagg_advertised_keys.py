"""Advertised SecAgg keys that must not be used: a key directory with a substituted neighbour key is
refused by the client (also once the genuine key was checked in the process), and a low-order
X25519 key advertised by a member leaves that member out instead of failing the round."""

import dataclasses

import numpy as np
import pytest

from protocols.identity import DeviceIdentity
from protocols.secagg import AdvertiseKeys, AggregateReady, BadSignature, ClientState, RoundConfig
from protocols.secagg.driver import make_identities, plain_fixed_point_sum, run_round

from secagg_rounds import AGGREGATOR, Round, resign


def test_client_rejects_a_key_directory_with_a_substituted_key():
    """Also when the neighbour's genuine advertisement was already checked in this process (by
    another member: a process verifies each advertisement once) -- and the genuine directory is
    still taken afterwards."""
    r = Round(n=6)
    r.step()
    directory = r.pending[0]
    entry = directory.neighbour_keys[0]
    warm = next(d for d in r.pending[1:] if d.recipient != entry.device_id)
    r.clients[warm.recipient].handle(warm)                   # entry's genuine keys now checked once
    fake = dataclasses.replace(entry, cipher_public_key=bytes(range(32)))
    tampered = resign(directory, AGGREGATOR, neighbour_keys=(fake,) + directory.neighbour_keys[1:])
    client = r.clients[directory.recipient]
    with pytest.raises(BadSignature):
        client.handle(tampered)
    assert client.state is ClientState.ADVERTISED
    client.handle(directory)
    assert client.state is ClientState.SHARES_SENT


@pytest.mark.parametrize("which", ["cipher_public_key", "mask_public_key"])
def test_a_low_order_advertised_key_leaves_its_device_out_instead_of_failing_the_round(which):
    """A review's finding: the server took a low-order X25519 key (32 zero bytes) at AdvertiseKeys;
    every honest neighbour's key agreement with it then failed and none answered: with the complete
    graph, one device failed every round it was in. Refused now; the honest devices' sum is exact."""
    ids = {i.device_id: i for i in make_identities(6)}
    config = RoundConfig.create(job_id="j", round_id=1, group_id="g", aggregator_id="aggregator",
                                members=list(ids), vector_length=16, bound=10.0)
    attacker = config.members[0]
    inputs = {d: np.full(16, float(k)) for k, d in enumerate(config.members)}

    def intercept(message):
        if isinstance(message, AdvertiseKeys) and message.sender == attacker:
            changed = dataclasses.replace(message, **{which: bytes(32)}, signature=b"")
            return [dataclasses.replace(changed, signature=ids[attacker].sign(changed.canonical_bytes()))]
        return [message]

    run = run_round(config, DeviceIdentity.generate("aggregator"), ids, inputs, intercept=intercept)
    assert isinstance(run.outcome, AggregateReady), run.outcome
    honest = tuple(d for d in config.members if d != attacker)
    assert run.outcome.survivors == honest
    assert np.array_equal(run.outcome.sum_words, plain_fixed_point_sum(config, [inputs[d] for d in honest]))
