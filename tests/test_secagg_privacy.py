"""What the server sees. Every frame the server receives is recorded (the driver's server view);
the tests show that no individual input can be read from it: masked vectors are statistically
uniform whatever the input (bit balance, byte chi-square, and equality of distribution between
two runs that differ only in one client's input), and no device ever hands over both the
self-mask share and the mask-key share of one peer, so the server can never rebuild both
secrets of anyone."""

import numpy as np
import pytest
from scipy import stats

from protocols.identity import DeviceIdentity
from protocols.secagg import AggregateReady, MaskedInput, Phase, RoundConfig, UnmaskShares
from protocols.secagg.driver import make_identities, run_round

AGGREGATOR = DeviceIdentity.generate("aggregator")
BOUND = 1.0
M = 4096


def _run(first_input, *, graph="complete", dropouts=None, seed=0):
    identities = {i.device_id: i for i in make_identities(10, prefix=f"dev{seed}")}
    config = RoundConfig.create(job_id="j", round_id=seed, group_id="g", aggregator_id="aggregator",
                                members=list(identities), vector_length=M, bound=BOUND, graph=graph,
                                degree=4 if graph == "regular" else None)
    # maximally structured inputs: any leak would show as non-uniform words
    inputs = {d: np.full(M, 0.5) for d in identities}
    inputs[config.members[0]] = first_input
    run = run_round(config, AGGREGATOR, identities, inputs, dropouts=dropouts or {}, record_server_view=True)
    assert isinstance(run.outcome, AggregateReady)
    received = [frame.to_message() for frame in run.server_view]
    return config, run, inputs, received


def _masked_inputs(received):
    return {m.sender: m.masked_input for m in received if isinstance(m, MaskedInput)}


def _bits(words):
    return np.unpackbits(words.view(np.uint8)).reshape(-1, 64)


@pytest.mark.parametrize("graph", ["complete", "regular"])
def test_masked_inputs_look_uniform(graph):
    config, run, inputs, received = _run(np.zeros(M), graph=graph)
    masked = _masked_inputs(received)
    assert set(masked) == set(config.members)
    for device, words in masked.items():
        encoded = config.codec.encode(inputs[device])
        assert np.count_nonzero(words == encoded) <= 1  # the input never shows through
        ones = _bits(words).mean(axis=0)  # per bit position, over M words
        sigma = 0.5 / np.sqrt(M)
        assert np.all(np.abs(ones - 0.5) < 5.5 * sigma), device
        byte_counts = np.bincount(words.view(np.uint8), minlength=256)
        assert stats.chisquare(byte_counts).pvalue > 1e-6, device


def test_view_is_independent_of_one_clients_input():
    """Two runs differing only in client 0's input (0 vs +B everywhere): the distributions of the
    word that client 0 sends are the same (two-sample KS on the high and low 32 bits)."""
    _, _, _, received_zero = _run(np.zeros(M), seed=1)
    _, _, _, received_bound = _run(np.full(M, BOUND), seed=2)
    first = sorted(_masked_inputs(received_zero))[0]
    y_zero = _masked_inputs(received_zero)[first]
    y_bound = _masked_inputs(received_bound)[sorted(_masked_inputs(received_bound))[0]]
    for shift in (np.uint64(32), np.uint64(0)):
        a = ((y_zero >> shift) & np.uint64(0xFFFFFFFF)).astype(np.float64)
        b = ((y_bound >> shift) & np.uint64(0xFFFFFFFF)).astype(np.float64)
        assert stats.ks_2samp(a, b).pvalue > 1e-6


@pytest.mark.parametrize("graph", ["complete", "regular"])
def test_server_never_receives_both_shares_of_any_device(graph):
    dropouts = {f"dev3-{i}": Phase.MASKED_INPUT for i in (1, 4)}
    config, run, _, received = _run(np.zeros(M), graph=graph, dropouts=dropouts, seed=3)
    self_mask_holders, key_holders = {}, {}
    for message in received:
        if isinstance(message, UnmaskShares):
            assert not set(message.self_mask_owners) & set(message.key_owners)
            for owner in message.self_mask_owners:
                self_mask_holders.setdefault(owner, set()).add(message.sender)
            for owner in message.key_owners:
                key_holders.setdefault(owner, set()).add(message.sender)
    # survivors: only self-mask shares; dropped devices: only mask-key shares
    assert set(self_mask_holders) == set(run.outcome.survivors)
    assert set(key_holders) <= set(dropouts) and not set(key_holders) & set(self_mask_holders)
    for client in run.clients.values():
        assert len(set(client.revealed)) == len(client.revealed)  # one kind per peer
    # and no device that sent a masked input ever had its mask-key shares disclosed
    assert not set(key_holders) & set(_masked_inputs(received))


def test_server_view_holds_no_plaintext_secret_shares():
    """Shares travel only inside AEAD ciphertexts: the recorded share uploads are exactly
    nonce + ciphertext + tag wide, and their bytes are uniform."""
    config, run, _, received = _run(np.zeros(M), seed=4)
    rows = np.concatenate([m.ciphertexts for m in received if m.TYPE == "secagg.encrypted_shares"])
    assert rows.shape[1] == 12 + 2 * 36 + 16
    assert stats.chisquare(np.bincount(rows.ravel(), minlength=256)).pvalue > 1e-6
