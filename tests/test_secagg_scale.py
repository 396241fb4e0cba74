"""Secure aggregation in large groups (issue #38): with the default graph ("auto") a group of 2,000
builds messages that fit the envelope, a round above the auto threshold is exact, the degree meets
its stated failure bounds, and a message that cannot be built fails its round once, with its reason.

References are independent of the code under test: scipy's binomial tail for the correctness bound,
scipy's connected components for the split rule, the plain fixed-point sum for exactness, and the
envelope's own encoder for the limits."""

import math
import random
import struct

import numpy as np
import pytest
from scipy.sparse import csr_matrix
from scipy.sparse.csgraph import connected_components
from scipy.stats import binom

from aggregator.jobs.fed3r_sync import Fed3RSyncConfig, Fed3RSyncJob
from aggregator.service.active_job import ActiveJob
from protocols.envelope import MAX_HEADER_BYTES, Envelope, EnvelopeError, encode
from protocols.identity import DeviceIdentity, IdentityRegistry
from protocols.payloads.secagg import SECAGG_TYPE, UnsendableMessage, from_envelope, to_envelope
from protocols.rounds import RoundClosed
from protocols.secagg import (AggregateReady, ClientSecAgg, GRAPH_COMPLETE, GRAPH_REGULAR, Message, Phase, RoundConfig,
                              ServerSecAgg)
from protocols.secagg.config import AUTO_COMPLETE_MAX_MEMBERS, resolve_graph
from protocols.secagg.driver import make_identities, plain_fixed_point_sum, run_round
from protocols.secagg.graph import CORRECTNESS_LOG2, SECURITY_LOG2, NeighbourGraph, regular_degree
from protocols.secagg.messages import ForwardedShares, UnmaskRequest, UnmaskShares

AGGREGATOR = DeviceIdentity.generate("aggregator")


def _create(members, **over):
    return RoundConfig.create(job_id="job", round_id=1, group_id="g1", aggregator_id="aggregator",
                              members=list(members), vector_length=over.pop("vector_length", 8),
                              bound=over.pop("bound", 1.0), **over)


# ---------------------------------------------------------------- a message that cannot be built
def test_a_key_directory_too_large_for_the_envelope_fails_the_round_once_with_its_reason(caplog):
    """The complete graph forced on 300 members: each key directory's header (about 240 bytes per
    member) exceeds 64 KiB. The job fails the round at once with that reason, tells the members to
    erase their secrets, raises nothing, and the round log entry says why."""
    n = 300
    identities = {i.device_id: i for i in make_identities(n, prefix="dev")}
    registry = IdentityRegistry({d: i.public_key_bytes for d, i in identities.items()})
    job = Fed3RSyncJob(Fed3RSyncConfig(job_id="big", num_classes=2, feature_dim=2, clients_per_round=n,
                                       max_samples=10, graph="complete"), identity=AGGREGATOR, registry=registry)
    chosen = job.next_participants(set(identities))
    round_id = job.secure.config.round_id
    clients = {d: ClientSecAgg(identities[d], "aggregator", AGGREGATOR.public_key_bytes, job_id="big",
                               round_id=round_id, group_id=f"g{round_id}") for d in chosen}
    starts = job.on_protocol_tick(0.0)
    assert len(starts) == n
    sends = []
    for device, env in starts:
        for reply in clients[device].handle(from_envelope(env)):
            sends += job.on_protocol(device, to_envelope(reply), 1.0)      # never raises
    assert job.secure is None and job.settled(round_id) == ()
    [(failed_round, reason)] = job.failed_rounds
    assert failed_round == round_id and "secagg.key_directory" in reason and str(MAX_HEADER_BYTES) in reason
    assert len(sends) == n and all(from_envelope(env).TYPE == "secagg.round_aborted" for _, env in sends)
    assert sum(r.levelname == "ERROR" for r in caplog.records) == 1             # one error, no traceback
    assert not any(r.exc_info for r in caplog.records)
    for device, env in sends:                                              # devices erase their secrets
        clients[device].handle(from_envelope(env))
    assert all(c.abort_reason is not None for c in clients.values())
    active = ActiveJob(job=job, kind="fed3r-sync", out_dir=None)
    entry = active.round_entry(RoundClosed(round_id, (), tuple(chosen), (), ()), 0.0, 1.0)
    assert entry["secure_failure"] == reason


def test_the_size_check_refuses_what_the_envelope_encoder_refuses():
    """to_envelope refuses (UnsendableMessage, an EnvelopeError) a message whose header encode()
    would refuse, and passes one well inside the limit."""
    for n_ids, fits in [(100, True), (200, True), (300, False), (1000, False)]:
        ids = tuple(f"{'peer' * 60}{i:05d}" for i in range(n_ids))            # 245-byte ids
        message = ForwardedShares(job_id="job", round_id=1, group_id="g1", sender="aggregator", recipient="dev0",
                                  senders=ids, ciphertexts=np.zeros((n_ids, 100), np.uint8)).signed(AGGREGATOR)
        header, arrays = message.to_wire()
        raw = Envelope(type=SECAGG_TYPE, sender="aggregator", body={"secagg": header}, tensors=dict(arrays))
        if fits:
            assert len(encode(raw)) > 0 and to_envelope(message).body == raw.body
        else:
            with pytest.raises(EnvelopeError, match="header too large"):
                encode(raw)
            with pytest.raises(UnsendableMessage, match="secagg.forwarded_shares to dev0"):
                to_envelope(message)
