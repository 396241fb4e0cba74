"""The masked-input upload window (aggregator/jobs/upload_window.py): a secure round's members
are asked for their masked inputs a window at a time, and the round's sum is unchanged.

A Fed3R-Sync group of 20 real clients (``ClientSecAgg``) runs through the job's service hooks,
with a byte budget that admits the minimum window (8): when the shares phase closes only 8
members get their shares, each masked input (or a member going offline) lets one more in, never
more than 8 are uploading, and the unmasked sum equals the numpy sum of the members' statistics.
"""

from __future__ import annotations

import numpy as np

from aggregator.jobs.fed3r_sync import Fed3RSyncConfig, Fed3RSyncJob
from aggregator.jobs.upload_window import MIN_WINDOW, window_size
from protocols.identity import DeviceIdentity, IdentityRegistry
from protocols.payloads.secagg import from_envelope, pack_sync_vector, to_envelope
from protocols.secagg import ClientSecAgg, Phase
from protocols.secagg.driver import make_identities

AGGREGATOR = DeviceIdentity.generate("aggregator")
N, P_FEATURES, CLASSES = 20, 3, 2


def _statistics(rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray, int]:
    """One device's Fed3R statistics (bias column included), features within the default bound."""
    n = int(rng.integers(1, 6))
    z = np.hstack([rng.uniform(-1, 1, (n, P_FEATURES)), np.ones((n, 1))])
    y = np.eye(CLASSES)[rng.integers(0, CLASSES, n)]
    return (z.T @ z)[np.triu_indices(P_FEATURES + 1)], y.T @ z, n


def _group(upload_window_bytes: int, n: int = N):
    identities = {i.device_id: i for i in make_identities(n, prefix="dev")}
    registry = IdentityRegistry({d: i.public_key_bytes for d, i in identities.items()})
    job = Fed3RSyncJob(Fed3RSyncConfig(job_id="paced", num_classes=CLASSES, feature_dim=P_FEATURES,
                                       clients_per_round=n, max_samples=10, upload_window_bytes=upload_window_bytes),
                       identity=AGGREGATOR, registry=registry)
    chosen = job.next_participants(set(identities))
    round_id = job.secure.config.round_id
    rng = np.random.default_rng(7)
    stats = {d: _statistics(rng) for d in chosen}
    clients = {d: ClientSecAgg(identities[d], "aggregator", AGGREGATOR.public_key_bytes, job_id="paced",
                               round_id=round_id, group_id=f"g{round_id}", input_vector=pack_sync_vector(*stats[d]))
               for d in chosen}
    return job, clients, stats


def _answer(job, clients, sends, now=1.0):
    """Each send delivered to its client, every reply fed back to the job: the job's next sends."""
    out = []
    for device, env in sends:
        for reply in clients[device].handle(from_envelope(env)):
            out += job.on_protocol(device, to_envelope(reply), now)
    return out


def _kinds(sends) -> list[str]:
    return [from_envelope(env).TYPE for _, env in sends]


def test_masked_inputs_are_asked_a_window_at_a_time_and_the_sum_is_exact():
    job, clients, stats = _group(upload_window_bytes=1)          # the smallest budget: MIN_WINDOW
    assert window_size(1, job.vector_length) == MIN_WINDOW < N
    directories = _answer(job, clients, job.on_protocol_tick(0.0))             # round start → keys
    forwarded = _answer(job, clients, directories)                              # keys → shares
    assert _kinds(forwarded) == ["secagg.forwarded_shares"] * MIN_WINDOW        # 8 of 20 asked
    assert job._uploads.held == N - MIN_WINDOW
    asked, uploading, most = len(forwarded), set(d for d, _ in forwarded), 0
    pending = list(forwarded)
    while pending:                                      # one member answers at a time
        device, env = pending.pop(0)
        [masked] = clients[device].handle(from_envelope(env))
        uploading.discard(device)
        sends = job.on_protocol(device, to_envelope(masked), 1.0)
        new = [(d, e) for d, e in sends if from_envelope(e).TYPE == "secagg.forwarded_shares"]
        assert len(new) <= 1                             # one answer lets one more in
        asked += len(new)
        uploading |= {d for d, _ in new}
        most = max(most, len(uploading))
        pending += new
        rest = [(d, e) for d, e in sends if (d, e) not in new]
        if rest:                                         # the last masked input closed the phase
            assert not pending and _kinds(rest) == ["secagg.consistency_request"] * N
            _answer(job, clients, _answer(job, clients, rest))                  # consistency → unmask
    assert asked == N and most <= MIN_WINDOW
    assert job.secure is None and sorted(job.settled(1)) == sorted(clients)
    np.testing.assert_allclose(job.strategy.packed_upper(), sum(s[0] for s in stats.values()), atol=1e-6)
    assert job._uploads.clear() is None         # said once, when the phase ended


def test_a_member_gone_while_waiting_its_turn_is_not_asked_and_frees_no_slot_twice():
    """A held member that goes offline is dropped from the queue (the server learns it is gone);
    an uploading member that goes offline lets the next one in; the round still sums the rest."""
    job, clients, stats = _group(upload_window_bytes=1)
    forwarded = _answer(job, clients, _answer(job, clients, job.on_protocol_tick(0.0)))
    asked = {d for d, _ in forwarded}
    waiting = sorted(set(clients) - asked)
    job.member_offline(waiting[0], 1.0)                   # gone before its turn: not asked, none released
    assert job._uploads.held == N - MIN_WINDOW - 1
    gone_uploading = sorted(asked)[0]
    released = job.member_offline(gone_uploading, 1.0)    # gone while uploading: the next one is asked
    assert _kinds(released) == ["secagg.forwarded_shares"]
    assert job.secure.phase is Phase.MASKED_INPUT
    pending = [(d, e) for d, e in forwarded if d != gone_uploading] + released
    asked_all = {d for d, _ in pending}
    while pending:
        sends = _answer(job, clients, [pending.pop(0)])
        more = [(d, e) for d, e in sends if from_envelope(e).TYPE == "secagg.forwarded_shares"]
        asked_all |= {d for d, _ in more}
        pending += more
        rest = [(d, e) for d, e in sends if (d, e) not in more]
        if rest:
            _answer(job, clients, _answer(job, clients, rest))
    assert waiting[0] not in asked_all and gone_uploading in asked
    survivors = sorted(set(clients) - {waiting[0], gone_uploading})
    assert sorted(job.settled(1)) == survivors
    np.testing.assert_allclose(job.strategy.packed_upper(), sum(stats[d][0] for d in survivors), atol=1e-6)


def test_the_round_log_says_how_long_each_phase_was_open():
    """The round entry of a secure round names its phases with the seconds each stayed open,
    measured on the clock the service passes in."""
    from aggregator.service.active_job import ActiveJob
    from protocols.rounds import RoundClosed

    job, clients, _ = _group(upload_window_bytes=2**30)            # no pacing: all 20 asked at once
    sends, now = job.on_protocol_tick(10.0), 10.0
    while sends:
        now += 2.0
        sends = _answer(job, clients, sends, now)
    entry = ActiveJob(job=job, kind="fed3r-sync", out_dir=None).round_entry(
        RoundClosed(1, tuple(clients), (), (), ()), 0.0, now)
    assert entry["secure_phase_s"] == {p.value: 2.0 for p in (Phase.ADVERTISE_KEYS, Phase.SHARE_KEYS,
                                                             Phase.MASKED_INPUT, Phase.CONSISTENCY_CHECK,
                                                             Phase.UNMASK)}


def test_members_that_never_upload_give_their_slots_up_and_the_round_goes_on(caplog):
    """The first window's members stay online and never upload (stuck, or hostile). They held every
    slot until the phase timed out, and everyone held behind them was dropped with them. A slot is
    leased for half the phase timeout (from the first tick that sees it): then the next members are
    asked, and the round sums everyone but the silent ones (40 members: 32 reach the threshold 27)."""
    caplog.set_level("INFO", logger="fedfleet.aggregator.secagg")
    job, clients, stats = _group(upload_window_bytes=1, n=40)
    lease = job.config.phase_timeout_s / 2
    forwarded = _answer(job, clients, _answer(job, clients, job.on_protocol_tick(0.0), 0.0), 0.0)
    silent = {d for d, _ in forwarded}
    assert len(silent) == MIN_WINDOW
    assert job.on_protocol_tick(1.0) == []                       # the lease starts at this tick
    assert job.on_protocol_tick(1.0 + lease - 0.01) == []         # still theirs
    released = job.on_protocol_tick(1.0 + lease)                 # before the phase timeout (2 leases)
    assert _kinds(released) == ["secagg.forwarded_shares"] * MIN_WINDOW
    assert job._uploads.overdue == MIN_WINDOW and not silent & {d for d, _ in released}
    assert f"{MIN_WINDOW} member(s) asked for their masked input sent nothing" in caplog.text
    now, pending = 1.0 + lease, list(released)
    while pending:                                                # the others upload, one at a time
        sends = _answer(job, clients, [pending.pop(0)], now)
        more = [(d, e) for d, e in sends if from_envelope(e).TYPE == "secagg.forwarded_shares"]
        pending += more
        if not pending and job.secure.phase is Phase.MASKED_INPUT:
            now += lease                                          # the next silent-free window's lease
            pending += job.on_protocol_tick(now)
    assert job._uploads.held == 0
    rest = job.on_protocol_tick(now + 2 * lease + 1)              # the phase times out on the silent ones
    while rest:
        rest = _answer(job, clients, rest, now + 2 * lease + 1)
    # the phase's summary, once: the 40 - 8 members held back when the shares went out
    summary = f"masked inputs asked {MIN_WINDOW} at a time: at most {40 - MIN_WINDOW} member(s) held back, " \
              f"{MIN_WINDOW} slot(s) taken back"
    assert caplog.text.count(summary) == 1
    survivors = sorted(set(clients) - silent)
    assert sorted(job.settled(1)) == survivors
    np.testing.assert_allclose(job.strategy.packed_upper(), sum(stats[d][0] for d in survivors), atol=1e-6)
