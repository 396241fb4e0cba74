"""The state added to the job kinds lately, through SIGKILLs and restarts from the store alone: the
FedAvg family's small-round reference (``SmallRoundReference``) and Scaffold's of its Δc bound,
LADD's φ and θ references (``LaddSmallRounds``), a sampled DP job's participant draw (``KeyedDraw``, or the config's
Twister while the noise is seeded) and its noise (one release per round, whatever the restarts).

Each job is killed at every durable point in turn — the round opened, a result stored, the close
about to be committed, the round closed with its checkpoint — and resumed by
``aggregator serve --state`` (tests/test_crash_resume_kinds.py's ``crashed``), and compared with the
same job run without interruption: the same participants round by round, the same model and the
same checkpoint (the references included), bit for bit. A keyed draw's secret key differs between
two jobs, so its crashed run is compared with the draws its own key (from its stored bookkeeping)
makes from the start, independently of the service.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import sqlite3
from pathlib import Path

import numpy as np
import pytest

from aggregator.jobs.participant_draw import KeyedDraw
from aggregator.jobs.registry import build_job
from aggregator.service.sealed_draws import SEALED
from aggregator.storage.store import Store
from aggregator.strategies.dp_noise import NOISE_SEED_ENV
from protocols.rounds import RoundClosed

from ops_fleet import C, D, feature_handlers, with_secure
from test_crash_resume_kinds import Case, common, crashed, ladd_case, uninterrupted

pytestmark = pytest.mark.slow       # aggregator processes killed and restarted

DEVICES = [f"dev{i:02d}" for i in range(6)]
# every durable point, a kill per process (counts are per process): the close committed with its
# checkpoint, the close about to be committed (the restart replays the round and closes it again),
# the round opened, a result stored, then the close again later in the job
DURABLE_POINTS = ["round_closed", "round_closing", "round_opened", "contribution_stored", "round_closed:2"]

FEDAVG = dict(num_classes=C, feature_dim=D, local_epochs=1, batch_size=8, client_lr=0.05, server_momentum=0.9)
# central DP, adaptive clipping, sampled (q = κ / dp_population < 1): the bound layers are off under DP
DP = dict(norm_bound_multiplier=0.0, contribution_bound_multiplier=0.0, dp_noise_multiplier=0.8, dp_clip_norm=0.5,
          dp_adaptive_clip=True, dp_population=10)


def fedavg_case(crashes: list[str], **over) -> Case:
    config = common(DEVICES, **FEDAVG, **over)
    return Case("fedavg", DEVICES, config, with_secure(None, feature_handlers), crashes)


def stored(state: Path) -> tuple[list, dict, dict]:
    """(each round's participants, the last checkpoint's state, results.json) of a finished job."""
    with sqlite3.connect(state) as db:
        rounds = [(r, json.loads(p)) for r, p in db.execute("SELECT round, participants FROM rounds ORDER BY round")]
    checkpoint = Store(state).checkpoint("job")
    assert checkpoint is not None
    return rounds, checkpoint[1], json.loads((state.parent / "out" / "job" / "results.json").read_text()) \
        if (state.parent / "out").exists() else {}


def assert_same_arrays(got: dict, want: dict) -> None:
    assert sorted(got) == sorted(want)
    for name in want:
        assert got[name].dtype == want[name].dtype and np.array_equal(got[name], want[name]), name


def crash_and_compare(case: Case, broker_url: str, tmp_path: Path, drawn: tuple[str, ...] = ()) -> tuple[dict, list]:
    """The crashed run against the uninterrupted one: participants, model, checkpoint (less the
    ``drawn`` entries, which each job draws anew: a stateful kind's run id); the checkpoint."""
    ref = uninterrupted(case, broker_url, tmp_path)
    out = crashed(case, broker_url, tmp_path / "crashed")
    want_rounds, want_state, _ = stored(tmp_path / "reference.db")
    got_rounds, got_state, _ = stored(tmp_path / "crashed" / "state.db")
    assert got_rounds == want_rounds
    assert_same_arrays(dict(np.load(out)), dict(np.load(ref)))
    assert_same_arrays({k: v for k, v in got_state.items() if k not in drawn},
                       {k: v for k, v in want_state.items() if k not in drawn})
    return got_state, got_rounds


def test_a_fedavg_job_of_lone_devices_resumes_its_small_round_reference_at_every_durable_point(broker, tmp_path):
    """κ = 1: every round is one device's, held (nothing moves) until three distinct devices' statistics
    make the reference, then bounded by it; the pool and the reference come back from each checkpoint."""
    case = fedavg_case(DURABLE_POINTS + ["contribution_stored:2"], rounds=7, clients_per_round=1)
    state, rounds = crash_and_compare(case, broker.url, tmp_path)
    assert all(len(p) == 1 for _, p in rounds) and len(rounds) == 7
    assert "unreleased_bounds.reference" in state          # not vacuous: a reference was made and kept


def stateful_handlers(root: Path):
    """The real device handlers on the synthetic features, each device with a state store of its own
    in each fleet (Scaffold's c_k): one fleet serves the uninterrupted run, one every crashed process."""
    from edge_client.handlers import HandlerConfig, device_handlers
    from edge_client.state import DeviceStateStore
    from ops_fleet import Features, features_of

    fleets = itertools.count()

    def plain(device: str) -> dict:
        store = DeviceStateStore(root / f"{device}-{next(fleets)}")
        return device_handlers(features_of(device), lambda *_, **__: Features(), HandlerConfig(), store)
    return with_secure(None, plain)


def test_a_scaffold_job_of_lone_devices_resumes_its_control_reference_at_every_durable_point(broker, tmp_path):
    """Scaffold, κ = 1: the Δc bound's reference of earlier rounds (and its pool) comes back from each
    checkpoint beside the model's, and c with it: the same c and checkpoint as the uninterrupted run."""
    config = common(DEVICES, **FEDAVG, rounds=7, clients_per_round=1, control_clip_norm=0.05)
    case = Case("scaffold", DEVICES, config, stateful_handlers(tmp_path / "device-state"),
                DURABLE_POINTS + ["contribution_stored:2"])
    state, rounds = crash_and_compare(case, broker.url, tmp_path, drawn=("device_state_run",))
    assert all(len(p) == 1 for _, p in rounds) and len(rounds) == 7
    assert {"unreleased_bounds.reference", "unreleased_scaffold.control_bounds.reference"} <= set(state)
    assert np.abs(state["control.weight"]).max() > 0            # not vacuous: c moved after the references


def test_a_ladd_job_of_lone_devices_resumes_its_phi_and_theta_references_at_every_durable_point(broker, tmp_path):
    """LADD's training rounds of one device each: φ's and the θ slots' references (and their pools)
    survive every kill; the style round (all devices) comes first."""
    case = ladd_case("ladd", tmp_path)
    case.config.update(clients_per_round=1, rounds=6)
    case.crashes = ["round_closed:2", "round_closing", "round_opened", "contribution_stored", "round_closed:2"]
    state, rounds = crash_and_compare(case, broker.url, tmp_path)
    assert [len(p) for _, p in rounds][1:] == [1] * 6
    assert any(k.startswith("unreleased_ladd.phi_bounds.") for k in state)
    assert any(k.startswith("unreleased_ladd.theta_bounds.") for k in state)


def test_a_sampled_dp_job_with_seeded_noise_resumes_to_the_uninterrupted_bits(broker, tmp_path, monkeypatch):
    """Sampled DP (q < 1), the noise seeded (tests only: FEDFLEET_TEST_DP_NOISE_SEED, with it the
    config's draw): the same rounds of the same devices and the same noisy model, bit for bit, and
    one release per closed round in the accountant's count and the mechanism's."""
    monkeypatch.setenv(NOISE_SEED_ENV, "17")
    case = fedavg_case(DURABLE_POINTS, rounds=5, clients_per_round=3, **DP)
    state, rounds = crash_and_compare(case, broker.url, tmp_path)
    results = json.loads((tmp_path / "crashed" / "out" / "job" / "results.json").read_text())
    assert int(state["dp_releases"][0]) == len(rounds) == 5
    assert results["final"]["privacy"]["releases"] == 5, results["final"]["privacy"]


def keyed_draws(config: dict, key: int, pool: set[str], rounds: int) -> list[list[str]]:
    """The participants a job of ``config`` draws from ``pool`` round after round under ``key``."""
    job = build_job("fedavg", {**config, "job_id": "job"})
    job._rng = KeyedDraw(key)
    out = []
    for _ in range(rounds):
        out.append(job.next_participants(pool))
        job.close_round(RoundClosed(job.round, tuple(out[-1]), (), (), ()))
    return out


def test_a_keyed_draw_resumes_at_every_durable_point_and_releases_each_round_once(broker, tmp_path):
    """Sampled DP with the noise cryptographic: the draw is AES-CTR under the job's secret key. The
    crashed run's rounds are exactly the draws its key makes from block 0 (no round drawn twice, none
    skipped, whatever the kills), the key never changes, and each closed round is one release."""
    case = fedavg_case(DURABLE_POINTS, rounds=5, clients_per_round=3, **DP)
    crashed(case, broker.url, tmp_path / "crashed")
    state_db = tmp_path / "crashed" / "state.db"
    draws = stored_draws(state_db)
    assert {version for version, _ in draws} == {SEALED}
    keys = {key for _, key in draws}
    assert len(keys) == 1
    key = keys.pop()
    assert_store_lacks(state_db, key)
    rounds, state, _ = stored(state_db)
    assert [p for _, p in rounds] == keyed_draws(case.config, key, set(DEVICES), 5)
    results = json.loads((tmp_path / "crashed" / "out" / "job" / "results.json").read_text())
    assert int(state["dp_releases"][0]) == len(rounds) == 5
    assert results["final"]["privacy"]["releases"] == 5


def opened_draw(state_db: Path, rng: list) -> list:
    """A stored round's participant draw as the job restores it: a sealed one opened with the key
    folder beside the store, a clear one as stored."""
    from aggregator.security.sealing_key import SealingKey
    from aggregator.service.sealed_draws import SEALED, SealedDraws

    if rng[0] != SEALED:
        return rng
    return SealedDraws(SealingKey(state_db.with_name(state_db.name + ".keys"))).opened({"rng": rng}, "job")["rng"]


def stored_draws(state_db: Path) -> list[tuple[object, int]]:
    """(the version stored, the key) of each stored round's participant draw."""
    out = []
    with sqlite3.connect(state_db) as db:
        for (b,) in db.execute("SELECT bookkeeping FROM rounds ORDER BY round"):
            rng = json.loads(b)["rng"]
            words = opened_draw(state_db, rng)[1]
            out.append((rng[0], (words[0] << 96) | (words[1] << 64) | (words[2] << 32) | words[3]))
    return out


def assert_store_lacks(state_db: Path, key: int) -> None:
    """No file of the store (the database, its WAL, its payload files) holds ``key``: not its bytes,
    not its hex, not the words of a keyed draw's saved state as JSON writes them."""
    words = [(key >> s) & 0xFFFFFFFF for s in (96, 64, 32, 0)]
    forms = [key.to_bytes(16, "big"), key.to_bytes(16, "big").hex().encode(), json.dumps(words)[1:-1].encode()]
    files = [p for p in state_db.parent.glob(state_db.name + "*") if p.is_file()]
    files += [p for p in state_db.with_name(state_db.name + ".blobs").rglob("*") if p.is_file()]
    assert state_db in files
    held = [(p.name, form) for p in files for form in forms if form in p.read_bytes()]
    assert not held, held


# ----------------------------------------------------------------------------- what an older version wrote
def rewrite_store(state_db: Path, checkpoint=None, bookkeeping=None) -> None:
    """The crashed job's store as an older version wrote it: ``checkpoint(state) -> state``,
    ``bookkeeping(round, dict) -> dict`` of every stored round."""
    store = Store(state_db)
    if checkpoint is not None:
        _, state, contributed = store.checkpoint("job")
        store.replace_checkpoint_state("job", checkpoint(state), contributed)
    if bookkeeping is not None:
        with sqlite3.connect(state_db) as db:
            for r, b in db.execute("SELECT round, bookkeeping FROM rounds").fetchall():
                db.execute("UPDATE rounds SET bookkeeping=? WHERE job_id='job' AND round=?",
                           (json.dumps(bookkeeping(r, json.loads(b))), r))


def resume(case: Case, broker_url: str, work: Path) -> tuple[int, str]:
    from test_crash_resume_kinds import AggregatorProcess
    from ops_fleet import Fleet

    with Fleet(broker_url, case.devices, handlers=case.handlers):
        return AggregatorProcess(work, broker_url, None).wait()


def test_a_checkpoint_without_the_small_round_reference_resumes_as_one_taken_before_it(broker, tmp_path):
    """A FedAvg checkpoint of the version before ``SmallRoundReference`` holds no ``bounds`` entries:
    the job resumes with no reference (its next lone round moves nothing) and builds one again."""
    case = fedavg_case(["round_closed:4"], rounds=8, clients_per_round=1)
    work = tmp_path / "crashed"
    crashed_until_killed(case, broker.url, work)
    rewrite_store(work / "state.db", checkpoint=lambda s: {k: v for k, v in s.items() if "bounds." not in k})
    rc, log = resume(case, broker.url, work)
    assert rc == 0, log[-3000:]
    rounds, state, _ = stored(work / "state.db")
    assert len(rounds) == 8 and "unreleased_bounds.reference" in state


def crashed_until_killed(case: Case, broker_url: str, work: Path) -> None:
    """``crashed`` without its last run: the job created through the API, killed at ``case.crashes``."""
    from test_crash_resume_kinds import job_created_through_the_api

    with job_created_through_the_api(case, broker_url, work) as first:
        rc, log = first.wait()
    assert rc == -9, log[-3000:]


def test_a_sampled_dp_job_resumed_from_a_twisters_bookkeeping_draws_keyed_from_then_on(broker, tmp_path):
    """Bookkeeping of the version before keyed draws holds a Mersenne Twister seeded by the config's
    seed, for a sampled DP job too. It still resumes; but a job that went on drawing from it drew
    every later round from a generator anyone holding the config can run (the amplification ε counts
    on gone for the rest of the job): the rounds opened after the resume are drawn keyed."""
    import random

    from aggregator.jobs.participant_draw import draw_state

    case = fedavg_case(["round_closed:2"], rounds=4, clients_per_round=3, **DP)
    work = tmp_path / "crashed"
    crashed_until_killed(case, broker.url, work)

    def twister(round_: int, b: dict) -> dict:
        old = random.Random(case.config["seed"])
        for _ in range(round_):
            old.random()
        return {**b, "rng": draw_state(old)}
    rewrite_store(work / "state.db", bookkeeping=twister)
    rc, log = resume(case, broker.url, work)
    assert rc == 0, log[-3000:]
    with sqlite3.connect(work / "state.db") as db:
        versions = [json.loads(b)["rng"][0] for (b,) in db.execute("SELECT bookkeeping FROM rounds ORDER BY round")]
    assert len(versions) == 4 and versions[2:] == [SEALED] * 2, versions      # keyed, the key stored sealed
    assert "drawn keyed from now on" in log


def test_a_sampled_dp_job_resumed_from_a_clear_draw_key_goes_on_under_a_new_sealed_one(broker, tmp_path):
    """The version before sealed draws stored the keyed draw's key in the clear. Such a store still
    resumes, but that key is spent (whoever read the store or a backup of it holds it, and with it
    every later draw): the rounds opened after the resume are drawn under a new key, stored sealed,
    and no file of the store holds the new key."""
    case = fedavg_case(["round_closed:2"], rounds=4, clients_per_round=3, **DP)
    work = tmp_path / "crashed"
    crashed_until_killed(case, broker.url, work)
    state_db = work / "state.db"
    rewrite_store(state_db, bookkeeping=lambda r, b: {**b, "rng": opened_draw(state_db, b["rng"])})
    old = stored_draws(state_db)
    assert [version for version, _ in old] == [KeyedDraw.VERSION] * 2 and len({key for _, key in old}) == 1
    rc, log = resume(case, broker.url, work)
    assert rc == 0, log[-3000:]
    assert "its participant draw's key was stored in the clear by an earlier version" in log
    draws = stored_draws(state_db)
    assert draws[:2] == old and [version for version, _ in draws[2:]] == [SEALED] * 2, draws
    new = {key for _, key in draws[2:]}
    assert len(new) == 1 and new != {old[0][1]}
    assert_store_lacks(state_db, new.pop())
    results = json.loads((work / "out" / "job" / "results.json").read_text())
    assert results["final"]["privacy"]["releases"] == 4


# ----------------------------------------------------------------------------- a store tampered with
def tamper_checkpoint(change):
    return lambda db: rewrite_store(db, checkpoint=change)


def tamper_bookkeeping(change):
    return lambda db: rewrite_store(db, bookkeeping=lambda r, b: change(b))


def truncate_checkpoint(db_path: Path) -> None:
    with sqlite3.connect(db_path) as db:
        db.execute("UPDATE checkpoints SET state=substr(state, 1, 100)")


TAMPERED = {
    "checkpoint not an npz": (truncate_checkpoint, "checkpoint"),
    "reference of too few layers": (tamper_checkpoint(lambda s: {**s, "unreleased_bounds.reference": np.ones(1)}),
                                    "unreleased_bounds.reference"),
    "reference not finite": (tamper_checkpoint(lambda s: {**s, "unreleased_bounds.reference": np.full(3, np.nan)}),
                             "unreleased_bounds.reference"),
    "pool devices without rows": (tamper_checkpoint(lambda s: {**{k: v for k, v in s.items() if k != "unreleased_bounds.pool"},
                                                               "unreleased_bounds.pool_devices": np.array(["dev00"])}),
                                  "unreleased_bounds.pool"),
    "pool rows not the devices'": (tamper_checkpoint(lambda s: {**s, "unreleased_bounds.pool_devices": np.array(["a", "b"]),
                                                                "unreleased_bounds.pool": np.ones((1, 3))}),
                                   "unreleased_bounds.pool"),
    "keyed draw's words": (tamper_bookkeeping(lambda b: {**b, "rng": [KeyedDraw.VERSION, [1, 2, 3], None]}),
                           "keyed draw"),
    "twister's state": (tamper_bookkeeping(lambda b: {**b, "rng": [3, [1, 2, 3], None]}), "bookkeeping"),
    "bookkeeping not json": (lambda db: sqlite3.connect(db).execute("UPDATE rounds SET bookkeeping='{'").connection.commit(),
                             "rounds"),
}


def test_a_tampered_store_stops_its_job_with_one_clear_error_once(broker, tmp_path):
    """Each tampered row of a killed job's store (its checkpoint, a reference in it, a round's saved
    draw): the restart says what is wrong in one line, stops the job durably with that reason, and
    the next restart does not try again — no traceback, no loop of restarts hitting it."""
    case = fedavg_case(["round_closed:4"], rounds=6, clients_per_round=1)
    killed = tmp_path / "killed"
    crashed_until_killed(case, broker.url, killed)
    store = Store(killed / "state.db")
    checkpoint = store.checkpoint("job")[1]
    store.close()       # before the copies: its last connection's close removes the WAL files copytree lists
    assert "unreleased_bounds.pool" in checkpoint or "unreleased_bounds.reference" in checkpoint
    assert_each_stops_its_job_once(killed, TAMPERED, broker.url, tmp_path)


def assert_each_stops_its_job_once(killed: Path, tampered: dict, broker_url: str, tmp_path: Path) -> None:
    """Each of ``tampered`` (name: (tamper(state.db), what the error names)) on a copy of the killed
    job's folder: one error line naming ``what`` at the first restart, none at the second, no
    traceback, the job stopped durably with that reason."""
    import shutil

    from test_crash_resume_kinds import AggregatorProcess

    problems = []
    for name, (tamper, what) in tampered.items():
        work = tmp_path / name.replace(" ", "_").replace("'", "")
        shutil.copytree(killed, work)
        tamper(work / "state.db")
        for attempt in range(2):
            rc, log = AggregatorProcess(work, broker_url, None).wait(60)
            errors = [line.split(" ERROR ")[-1] for line in log.splitlines() if "cannot start job job" in line]
            if "Traceback" in log or len(errors) != 1 - attempt or (errors and what not in errors[0]):
                problems.append((name, attempt, rc, errors, log[-1500:] if "Traceback" in log else ""))
        row = Store(work / "state.db").job("job")
        if row["state"] != "stopped" or what not in json.dumps(row):
            problems.append((name, row["state"], row.get("error")))
    assert not problems, "\n".join(map(str, problems))


def sealed_draws_changed(change):
    """tamper(state.db): each stored round's sealed draw replaced by ``change(state_db, sealed)``."""
    def tamper(state_db: Path) -> None:
        with contextlib.closing(sqlite3.connect(state_db)) as db:
            rng = [json.loads(b)["rng"] for (b,) in db.execute("SELECT bookkeeping FROM rounds")]
        assert rng and all(r[0] == SEALED for r in rng), rng        # what is tampered with is a sealed draw
        rewrite_store(state_db, bookkeeping=lambda r, b: {**b, "rng": change(state_db, b["rng"])})
    return tamper


def altered_token(state_db: Path, rng: list) -> list:
    import base64

    token = bytearray(base64.b64decode(rng[1]))
    token[-1] ^= 1                              # the tag's last bit
    return [rng[0], base64.b64encode(bytes(token)).decode(), None]


def another_jobs(state_db: Path, rng: list) -> list:
    """The same draw sealed under the same key for job "other": a row copied from that job."""
    from aggregator.security.sealing_key import SealingKey
    from aggregator.service.sealed_draws import SealedDraws

    draws = SealedDraws(SealingKey(state_db.with_name(state_db.name + ".keys")))
    return draws.sealed({"rng": opened_draw(state_db, rng)}, "other")["rng"]


def keys_replaced(state_db: Path) -> None:
    """The store moved to a host whose key folder holds another key."""
    from aggregator.security.sealing_key import SealingKey

    keys = state_db.with_name(state_db.name + ".keys")
    sealed_draws_changed(lambda _db, rng: rng)(state_db)
    (keys / SealingKey.FILE).unlink()
    SealingKey(keys).seal(b"", b"")


def keys_gone(state_db: Path) -> None:
    """The store moved without its key folder."""
    import shutil

    sealed_draws_changed(lambda _db, rng: rng)(state_db)
    shutil.rmtree(state_db.with_name(state_db.name + ".keys"))


SEALED_TAMPERED = {
    "sealed draw altered": (sealed_draws_changed(altered_token), "does not open"),
    "sealed draw of another job": (sealed_draws_changed(another_jobs), "does not open"),
    "another key folder": (keys_replaced, "does not open"),
    "no key folder": (keys_gone, "no sealing key"),
}


def test_a_sealed_draw_that_does_not_open_stops_its_job_with_one_clear_error_once(broker, tmp_path):
    """A sampled DP job's stored draw altered, copied from another job, or opened under another key
    folder (or none): the restart says in one line that the round's bookkeeping does not open, stops
    the job with that reason, and goes on (the next restart does not try again)."""
    case = fedavg_case(["round_closed:2"], rounds=4, clients_per_round=3, **DP)
    killed = tmp_path / "killed"
    crashed_until_killed(case, broker.url, killed)
    assert_each_stops_its_job_once(killed, SEALED_TAMPERED, broker.url, tmp_path)


def test_a_ladd_checkpoint_without_its_references_resumes_as_one_taken_before_them(tmp_path):
    """A LADD checkpoint of the version before ``LaddSmallRounds`` holds no ``ladd.*_bounds`` entries:
    it loads as a job with no reference and an empty pool (a lone round then moves nothing), and one
    holding them (two lone rounds' pool) loads them back bit for bit."""
    from test_ladd_small_rounds import (EVIL, KIND_TRAIN, config_of, decode, encode_update, message, model_of,
                                        play, update_of)

    job, _, _ = play(tmp_path / "played", [["d0"], ["d3"]], total_rounds=3)     # a pool of two, no reference
    state = job.state_dict()
    ours = {k for k in state if k.startswith("unreleased_ladd.")}
    assert {"unreleased_ladd.phi_bounds.pool", "unreleased_ladd.theta_bounds.pool"} <= ours
    config = config_of(tmp_path / "played", rounds=3)
    again = build_job("ladd", config)
    again.load_state_dict(state)
    assert_same_arrays(again.state_dict(), state)
    old = build_job("ladd", config)
    old.load_state_dict({k: v for k, v in state.items() if k not in ours})
    assert old.small_rounds.state_dict() == {} and not old.small_rounds.phi.pool and old.small_rounds.theta.limits is None
    before = model_of(old)
    assert old.next_participants({EVIL}) == [EVIL]
    arrays, n = update_of(old, EVIL, np.random.default_rng(0))
    old.apply(EVIL, old.parse_result(decode(message(EVIL, old.round, KIND_TRAIN,
                                                    *encode_update(arrays, old.trainable_layout, n, old.assignment[EVIL])))))
    old.close_round(RoundClosed(old.round, (EVIL,), (), (), ()))
    after = model_of(old)
    assert np.array_equal(after[0], before[0]) and all(np.array_equal(after[1][c], before[1][c]) for c in before[1])
