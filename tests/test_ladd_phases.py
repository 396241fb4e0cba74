"""LADD's phase machine (LADD_TABLE): every row fires, the docs show the table, DONE ends the job
(also when the privacy budget ends training early), old checkpoints load, replays re-enter the phase."""

import json
import re
from pathlib import Path

import numpy as np
import pytest

from aggregator.jobs.ladd import LADD_TABLE, LaddConfig, LaddJob, render_table
from aggregator.jobs.ladd_phases import LaddPhase
from protocols.payloads.ladd import encode_style
from protocols.rounds import RoundClosed

from test_ladd_aggregation import DEVICES, INITIAL, TRAINABLE, send, style_of

ROOT = Path(__file__).resolve().parents[1]


def job_of(initial=True, **over):
    cfg = dict(model={"num_classes": 5, "image_size": 64}, rounds=2, clients_per_round=3, k_min=1, k_max=2,
               n_init=1, style_attempts=2, kd_lambda=0.0, seed=3)
    source = dict(initial=(INITIAL, TRAINABLE)) if initial else dict(pretrainer=lambda bank: (INITIAL, TRAINABLE))
    return LaddJob(LaddConfig(**{**cfg, **over}), **source)


@pytest.fixture
def fired(monkeypatch):
    """(state, row) of every LADD_TABLE firing while the test runs."""
    seen, real = set(), LADD_TABLE.fire

    def fire(machine, event):
        seen.add((machine.state.name, LADD_TABLE.describe(LADD_TABLE.select(machine, event))))
        return real(machine, event)
    monkeypatch.setattr(LADD_TABLE, "fire", fire)
    return seen


def step(job, online, rng) -> bool:
    """One scheduling tick: open a round if the job wants one, some participants answer, close it."""
    parts = job.next_participants(online)
    if not parts:
        return False
    answered = [d for d in parts if job.kind != "ladd.style" or rng.random() < 0.7]
    for d in answered if job.kind == "ladd.style" else ():
        job.apply(d, send(job, d, "ladd.style", *encode_style(style_of(d), 4, 1)))
    accepted = tuple(answered) if job.kind == "ladd.style" else ()
    job.close_round(RoundClosed(job.round, accepted, tuple(d for d in parts if d not in accepted), (), ()))
    return True


def test_every_table_row_fires_in_every_state_it_names(fired):
    """Seeded random jobs (clustering, min_styles, rounds, who is online and answers) reach each
    (state, row) of the table, but one: a style round closing in DONE, which only a job run before
    DONE existed can leave open (test_a_checkpoint_from_before_done_loads_as_done reaches it)."""
    rng = np.random.default_rng(5)
    for _ in range(40):
        job = job_of(initial=rng.random() < 0.5, clustering=str(rng.choice(["styles", "none"])),
                     min_styles=int(rng.choice([0, 0, 4, 9])), rounds=int(rng.integers(0, 3)))
        for _ in range(12):
            online = {d for d in DEVICES if rng.random() < 0.6}
            if not step(job, online, rng) and job.finished(online, online):
                break
    names = {(state.name, LADD_TABLE.describe(row)) for state, row in LADD_TABLE.entries()}
    assert names - fired == {("DONE", "all but STYLES StyleRoundClosed")}


def test_docs_show_the_table_rendered_from_the_data():
    block = re.search(r"```ladd-phases\n(.*?)\n```", (ROOT / "docs/ladd.md").read_text(), re.S)
    assert block and block.group(1) == render_table(), "stale: paste `python -m aggregator.jobs.ladd` into docs/ladd.md"


def test_done_opens_no_round_when_the_budget_ends_training_early():
    """The budget allows fewer training rounds than ``rounds``: after the last, a late device is not
    asked for its style (before DONE, the job went on opening style rounds for late devices)."""
    job = job_of(rounds=1000, dp_noise_multiplier=2.0, dp_population=6, dp_target_epsilon=2.5)
    first = set(DEVICES[:6])
    while job.phase is not LaddPhase.DONE:
        assert step(job, first, np.random.default_rng(0))
    assert 0 < job.train_round < 1000 and job.budget_exhausted
    assert job.next_participants(set(DEVICES)) == [] and job.finished(set(DEVICES), set(DEVICES))
    assert job.report()["phase"] == "done"


def test_a_checkpoint_from_before_done_loads_as_done(fired):
    """Old checkpoints say "train" after their last round: loaded, the job is DONE and schedules
    nothing; a style round such a job left open still closes (late devices routed)."""
    job = job_of(rounds=1)
    rng = np.random.default_rng(1)
    while not job.finished(set(DEVICES[:6]), set()):
        step(job, set(DEVICES[:6]), rng)
    state = job.state_dict()
    meta = json.loads(state["meta"].tobytes())
    assert meta["phase"] == "done"
    old = {**state, "meta": np.frombuffer(json.dumps({**meta, "phase": "train"}).encode(), np.uint8).copy()}
    restored = job_of(rounds=1)
    restored.load_state_dict(old)
    assert restored.phase is LaddPhase.DONE and restored.next_participants(set(DEVICES)) == []
    assert {k: v.tolist() for k, v in restored.state_dict().items()} == {k: v.tolist() for k, v in state.items()}
    late = DEVICES[8]
    restored.restore_bookkeeping({**restored.bookkeeping(), "round": restored.round + 1, "kind": "ladd.style",
                                  "open": True, "participants": [late]})
    restored.apply(late, send(restored, late, "ladd.style", *encode_style(style_of(late), 4, 1)))
    restored.close_round(RoundClosed(restored.round, (late,), (), (), ()))
    assert late in restored.assignment and ("DONE", "all but STYLES StyleRoundClosed") in fired


def test_a_replayed_training_round_that_ended_the_style_phase_re_enters_train():
    """The style phase can end at scheduling (nobody left to ask) as the first training round
    opens; a restart replaying that round's bookkeeping ends it the same way, with the same clusters."""
    job = job_of(rounds=2)
    rng = np.random.default_rng(2)
    first = set(DEVICES[:5])
    parts = job.next_participants(first)
    for d in parts[:-1]:
        job.apply(d, send(job, d, "ladd.style", *encode_style(style_of(d), 4, 1)))
    job.close_round(RoundClosed(job.round, tuple(parts[:-1]), (parts[-1],), (), ()))
    style_book = job.bookkeeping()
    assert job.phase is LaddPhase.STYLES
    train = job.next_participants(first - {parts[-1]})
    assert job.phase is LaddPhase.TRAIN and job.kind == "ladd.train" and train
    replay = job_of(rounds=2)
    replay.restore_bookkeeping({**style_book, "round": 1, "open": True, "participants": parts, "kind": "ladd.style"})
    for d in parts[:-1]:
        replay.apply(d, send(replay, d, "ladd.style", *encode_style(job.styles[d], 4, 1)))
    replay.close_round(RoundClosed(1, tuple(parts[:-1]), (parts[-1],), (), ()))
    replay.restore_bookkeeping(job.bookkeeping())
    assert replay.phase is LaddPhase.TRAIN and replay.assignment == job.assignment and replay.kind == "ladd.train"
    replay.close_round(RoundClosed(replay.round, (), tuple(train), (), ()))
    assert replay.train_round == 1 and step(replay, first, rng)
