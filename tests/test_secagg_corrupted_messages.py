"""Corrupted SecAgg content from a member or on the way: tampered forwarded shares, masked inputs of
the wrong length or ring, share uploads to the wrong recipients, wrong unmask shares (outvoted
while there are spare ones, a failed round otherwise, never a wrong sum), a self-mask commitment
its shares do not open to. Each is refused with nothing applied, or ends in RoundFailed."""

import dataclasses

import numpy as np
import pytest

from protocols.secagg import (AggregateReady, BadSignature, ClientState, EncryptedShares, MalformedMessage, Phase,
                              RoundConfig, RoundFailed, ServerState, UnmaskShares)
from protocols.secagg.driver import make_identities, plain_fixed_point_sum, run_round

from secagg_rounds import AGGREGATOR, BOUND, Round, rejects, resign


def test_tampered_forwarded_shares_fail_the_server_signature():
    r = Round()
    r.step()
    r.step()
    forwarded = r.pending[0]
    ciphertexts = forwarded.ciphertexts.copy()
    ciphertexts[0, 0] ^= 1
    client = r.clients[forwarded.recipient]
    with pytest.raises(BadSignature):
        client.handle(dataclasses.replace(forwarded, ciphertexts=ciphertexts))
    assert client.state is ClientState.SHARES_SENT


@pytest.mark.parametrize("length_change", [1, -1, 10**4])
def test_wrong_length_masked_input_is_rejected_without_touching_the_sum(length_change):
    r = Round(n=5, m=40)
    r.step()
    r.step()
    masked = r.to_clients()
    device = masked[0].sender
    vector = np.resize(masked[0].masked_input, 40 + length_change).astype("<u8")
    rejects(r.server, resign(masked[0], r.identities[device], masked_input=vector), MalformedMessage)
    r.to_server(masked)
    outcome = r.finish()
    assert np.array_equal(outcome.sum_words, r.expected_sum(r.config.members))



@pytest.mark.parametrize("ring_bits,wrong", [(32, "<u8"), (64, "<u4")])
def test_masked_input_of_the_other_ring_is_rejected_without_touching_the_sum(ring_bits, wrong):
    """A masked input must be made of the round's ring words: a 32-bit round refuses 64-bit words
    (and the reverse), even when their values would fit, and the round still ends exact."""
    r = Round(n=5, m=40, ring_bits=ring_bits)
    r.step()
    r.step()
    masked = r.to_clients()
    device = masked[0].sender
    assert masked[0].masked_input.dtype == np.dtype({32: "<u4", 64: "<u8"}[ring_bits])
    vector = masked[0].masked_input.astype(wrong)
    with pytest.raises(MalformedMessage, match=f"{ring_bits}-bit ring"):
        r.server.handle(resign(masked[0], r.identities[device], masked_input=vector))
    rejects(r.server, resign(masked[0], r.identities[device], masked_input=vector), MalformedMessage)
    r.to_server(masked)
    outcome = r.finish()
    assert outcome.sum_words.dtype == masked[0].masked_input.dtype
    assert np.array_equal(outcome.sum_words, r.expected_sum(r.config.members))


def test_share_upload_to_the_wrong_recipients_is_rejected():
    r = Round(n=6)
    r.step()
    shares = r.to_clients()
    first = shares[0]
    rejects(r.server, resign(first, r.identities[first.sender], recipients=first.recipients[:-1],
                             ciphertexts=first.ciphertexts[:-1]), MalformedMessage)
    rejects(r.server, resign(first, r.identities[first.sender], ciphertexts=first.ciphertexts[:, :-1]),
            MalformedMessage)


def _round_with_corrupted_unmask_shares(kind: str, corrupters: int, members: int = 7):
    """A round where member 0 drops before masking (its mask key is reconstructed) and the
    ``corrupters`` lowest-x responders, whose shares the server interpolates first, send wrong ones."""
    identities = {i.device_id: i for i in make_identities(members)}
    config = RoundConfig.create(job_id="j", round_id=1, group_id="g", aggregator_id="aggregator",
                                members=list(identities), vector_length=30, bound=BOUND, consistency_check=False)
    bad = set(config.members[1:1 + corrupters])
    inputs = {d: np.full(30, float(i)) for i, d in enumerate(config.members)}

    def corrupt(message):
        if isinstance(message, UnmaskShares) and message.sender in bad:
            field = "self_mask_shares" if kind == "self_mask" else "key_shares"
            # random wrong shares: a structured change (one bit of each) can cancel out between two
            # holders' Lagrange weights and open to the right secret after all
            shares = rng.integers(0, 256, getattr(message, field).shape, dtype=np.uint8)
            return [resign(message, identities[message.sender], **{field: shares})]
        return [message]

    rng = np.random.default_rng(5)
    run = run_round(config, AGGREGATOR, identities, inputs, intercept=corrupt,
                    dropouts={config.members[0]: Phase.MASKED_INPUT})
    return config, inputs, run


@pytest.mark.parametrize("kind", ["self_mask", "key"])
def test_a_holder_with_corrupted_unmask_shares_is_outvoted_and_the_sum_is_exact(kind):
    """One device sending wrong shares failed every round whose reconstruction used its shares (the
    lowest x's are interpolated first). The secrets are checked (commitment, public key), so the
    server tries the sets that leave holders out until one opens to the confirmed secret."""
    config, inputs, run = _round_with_corrupted_unmask_shares(kind, corrupters=1)
    assert config.share_threshold < len(config.members) - 1            # one spare share: the wrong one is outvoted
    assert isinstance(run.outcome, AggregateReady), run.outcome
    survivors = tuple(config.members[1:])
    assert run.outcome.survivors == survivors
    assert np.array_equal(run.outcome.sum_words, plain_fixed_point_sum(config, [inputs[d] for d in survivors]))


@pytest.mark.parametrize("kind", ["self_mask", "key"])
def test_more_wrong_unmask_shares_than_spare_ones_fail_the_round_instead_of_a_wrong_sum(kind):
    config, _, run = _round_with_corrupted_unmask_shares(kind, corrupters=2)
    assert len(config.members) - 1 - config.share_threshold == 1       # six responders, one spare share
    assert isinstance(run.outcome, RoundFailed)
    assert "opens to the confirmed secret" in run.outcome.reason, run.outcome.reason


def test_a_member_committing_to_another_self_mask_than_it_shared_fails_the_round_named_in_the_reason():
    """A review's finding, not closed (docs: Known gaps): one member's EncryptedShares with a self-mask
    commitment that its shares do not open to (its own message, signed by itself) fails the round at
    the unmasking, every round it is drawn into. Its holders could have lied alike, so it is no
    culprit; the reason says it may be its own dealing rather than only blaming wrong shares."""
    run = Round(n=8)
    evil = sorted(run.identities)[0]
    run.step()
    shares = [dataclasses.replace(m, self_mask_commitment=bytes(32)).signed(run.identities[evil])
              if isinstance(m, EncryptedShares) and m.sender == evil else m for m in run.to_clients()]
    run.to_server(shares)
    outcome = run.finish()
    assert isinstance(outcome, RoundFailed) and not run.server.culprits
    assert f"self-mask seed of {evil!r}" in outcome.reason and f"{evil!r} dealt its shares wrong" in outcome.reason


def test_server_refuses_unmask_shares_that_reveal_both_secrets_of_a_peer():
    r = Round(n=6, consistency_check=False)
    for _ in range(3):
        r.step()
    assert r.server.state is ServerState.WAIT_UNMASK
    replies = r.to_clients()
    reply = replies[0]
    owner = reply.self_mask_owners[0]
    both = resign(reply, r.identities[reply.sender], key_owners=(owner,), key_shares=reply.self_mask_shares[:1])
    rejects(r.server, both, MalformedMessage)
