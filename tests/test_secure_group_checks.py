"""A secure group's sum is checked against what its honest members can send before anything of it
is applied (a review's findings, each a way one member moved or sabotaged the model unnoticed):

* (a count slot of 0, which settled the round silently: tests/test_secure_stateful.py);
* under distributed DP no check ran at all: one member could mask any ring element;
* secure LADD checked its cluster counts but not its weight slots: n = 1 − Σ others' n made φ's
  "mean" the weighted sum itself;
* Fed3R-Sync under distributed DP (and its DP center round) released any sum; plain Fed3R-Sync
  left A's off-diagonal and the class counts unchecked (a sum no honest group can send).
"""

import numpy as np
import pytest

from aggregator.jobs.secure_rounds import GroupSumOutOfBound
from protocols.payloads.ditto import KIND as DITTO_KIND
from protocols.payloads.secagg import pack_weighted

from test_ladd_secure import three_member_round
from test_secure_stateful import DEVICES, HEAD, keys, secure_job  # noqa: F401  (keys: fixture)


def test_dp_group_sum_beyond_every_members_bound_is_discarded(tmp_path, keys):
    job = secure_job(DITTO_KIND, tmp_path, keys, dp_noise_multiplier=1.0, dp_clip_norm=1.0)
    members = tuple(job.next_participants(set(DEVICES)))
    bound = job.secure.config.bound                      # what any honest member's entry respects
    before = {k: v.copy() for k, v in job.params.items()}
    honest = {k: np.full(job.params[k].shape, 0.1) for k in HEAD}
    evil = {k: np.full(job.params[k].shape, 1e6) for k in HEAD}
    total = pack_weighted(evil, HEAD, 1) + sum(pack_weighted(honest, HEAD, 1) for _ in members[1:])
    assert np.abs(total).max() > len(members) * bound    # no set of honest members can send this
    job.group_summed(job.round, total, members)
    reason = job.secure_failure(job.round)
    moved = max(float(np.abs(job._sum[0][k]).max()) for k in HEAD) if job._sum else 0.0
    assert reason is not None and "out of bound" in reason, \
        f"accepted: mean update entry {moved:.3g} (signed bound per member {bound:.3g})"


def honest_tensors(slots, rng, scale):
    names = slots.global_layout + slots.slot_layout
    return {name: rng.uniform(-scale, scale, size=shape) for name, shape in names}


def test_forged_weight_slot_turns_the_mean_into_the_sum():
    job, identities, _ = three_member_round()
    ids = list(identities)
    slots = job.slots
    rng = np.random.default_rng(0)
    max_abs = job.config.max_abs_param          # 50
    n = job.config.max_samples                  # 100
    honest = [slots.pack(honest_tensors(slots, rng, 0.9 * max_abs), n, 0) for _ in ids[:2]]
    # the attacker: a legitimate-looking update, its weight slot forged so that Σ n = 1
    forged = slots.pack(honest_tensors(slots, rng, 0.9 * max_abs), 1, 0)
    tail = slots.tensors_size
    forged[tail] = 1 - 2 * n                     # |-199| << the round's bound max_samples·max_abs_param
    assert np.abs(forged).max() <= job.bound
    total = honest[0] + honest[1] + forged
    with pytest.raises(GroupSumOutOfBound, match="outside"):
        job.on_secure_sum(total, tuple(ids))
    assert job._round_sum is None and not job.contributed
    job.on_secure_sum(honest[0] + honest[1] + slots.pack(honest_tensors(slots, rng, 0.9 * max_abs), n, 0),
                      tuple(ids))                # three honest members: taken
    assert job._round_sum is not None


def fed3r_sync_job(**over):
    from aggregator.jobs.fed3r_sync import Fed3RSyncConfig, Fed3RSyncJob
    from protocols.identity import DeviceIdentity, IdentityRegistry

    devices = [f"cam-{i}" for i in range(6)]
    ids = {d: DeviceIdentity.generate(d) for d in devices}
    config = Fed3RSyncConfig(**{"num_classes": 3, "feature_dim": 5, "clients_per_round": 3, "max_samples": 4, **over})
    job = Fed3RSyncJob(config, identity=DeviceIdentity.generate("aggregator"),
                       registry=IdentityRegistry({d: k.public_key_bytes for d, k in ids.items()}))
    return job, tuple(job.next_participants(set(devices)))


@pytest.mark.parametrize("center", [False, True], ids=["dp-round", "dp-center-round"])
def test_a_dp_fed3r_sync_sum_beyond_every_members_bound_is_discarded_not_released(center):
    """A review's finding: one member of a distributed-DP Fed3R-Sync group (or of its DP center round)
    masked an entry of 1e6 × what the group can send, and it was released into the model (A[0,0]
    9.4e8 where three members can send 939) or the center (1.2e8)."""
    over = dict(dp_center_devices=3, dp_center_clip_norm=1.0) if center else {}
    job, members = fed3r_sync_job(dp_noise_multiplier=1.5, feature_clip_norm=2.0, **over)
    bound, length = job.secure.config.bound, job.secure.config.vector_length
    honest = np.zeros(length)
    honest[-1] = len(members)                          # each member's count slot (1 scaled, or its n)
    forged = honest.copy()
    forged[0] = 1e6 * bound * len(members)
    job.group_summed(job.round, forged, members)
    assert "out of bound" in (job.secure_failure(job.round) or "")
    assert job.strategy.releases == 0 if not center else job.strategy.center.value is None
    assert set(job.contributed) == set(members)         # unmasked: released, never asked again
    job2, members2 = fed3r_sync_job(dp_noise_multiplier=1.5, feature_clip_norm=2.0, **over)
    job2.group_summed(job2.round, honest, members2)    # within the bound: taken
    assert job2.secure_failure(job2.round) is None


def test_a_plain_fed3r_sync_sum_no_honest_group_can_send_is_discarded():
    """Within the ring's bound one member set A's off-diagonal (A's least eigenvalue −128.7) and a
    class count (121 in a group of 60 samples, widening b's allowance): the sum must be a sum of
    Gram matrices with counts adding up to n."""
    from protocols.payloads.secagg import pack_sync_vector

    rng = np.random.default_rng(3)
    job, members = fed3r_sync_job(max_abs_feature=2.0)
    Z = rng.uniform(-2, 2, (12, 5))
    y = rng.integers(0, 3, 12)
    Zb = np.hstack([Z, np.ones((12, 1))])
    a_upper = (Zb.T @ Zb)[np.triu_indices(6)]
    b = np.stack([Zb[y == c].sum(0) for c in range(3)])
    off = a_upper.copy()
    off[1] += 150                                       # A[0, 1]
    count = b.copy()
    count[0, -1] += 100
    for forged, why in ((pack_sync_vector(off, b, 12), "Gram"), (pack_sync_vector(a_upper, count, 12), "bias")):
        job, members = fed3r_sync_job(max_abs_feature=2.0)
        job.group_summed(job.round, forged, members)
        assert why in (job.secure_failure(job.round) or ""), job.secure_failure(job.round)
    job, members = fed3r_sync_job(max_abs_feature=2.0)
    job.group_summed(job.round, pack_sync_vector(a_upper, b, 12), members)
    assert job.secure_failure(job.round) is None and job.group_samples == [12]


def test_an_honest_plain_fed3r_sync_group_passes_its_shape_check_through_the_fixed_point_codec():
    """The last review's finding on the shape check: each member rounds its statistics to the ring's
    grid, so a feature of 3e-7 (a ReLU output nearly always 0) has its A_ii rounded to 0 while its
    products with large features stay: honest groups were discarded (20 of 20). The check allows
    each member's rounding."""
    from edge_client.fed3r import Fed3RAccumulator
    from protocols.payloads.secagg import pack_sync_vector

    rng = np.random.default_rng(5)
    for tiny in (3e-7, 1e-6, 0.0):
        job, members = fed3r_sync_job(max_abs_feature=6.0, max_samples=10_000)
        codec = job.secure.config.codec
        total = None
        for _ in members:
            X = rng.uniform(0, 6, (200, 5))
            X[:, 0] = 0.0
            X[0, 0] = tiny                                  # one activation of a nearly dead feature
            acc = Fed3RAccumulator(3, 5, True)
            acc.update(X, rng.integers(0, 3, 200))
            words = codec.encode(pack_sync_vector(acc.A[np.triu_indices(6)], acc.B, acc.n))
            total = words if total is None else total + words
        job.group_summed(job.round, codec.decode(total), members)
        assert job.secure_failure(job.round) is None, (tiny, job.secure_failure(job.round))

