"""The sample-window rule (``edge_client/sample_windows.py``): a curious aggregator chooses which of a
device's samples a Fed3R task covers (``from_sample``, ``max_samples`` with ``cap_samples``); two
answers over windows one sample apart differ by exactly that sample's z zᵀ and z yᵀ. The attack is
shown working (reconstructed sample = the device's own, by numpy) with the rule off
(``min_difference=1``), and declined by the default rule, across restarts too; honest streaming,
re-runs and DP caps are answered."""

from __future__ import annotations

import json
import logging
import os

import numpy as np
import pytest

from edge_client.agent import TaskDeclined
from edge_client.sample_windows import LOST_REASON, MAX_BOUNDARIES, MIN_DIFFERENCE, WINDOWS_FILE, SampleWindowLedger
from edge_client.tasks.fed3r_stats import Fed3RStatsTask
from protocols.payloads.fed3r import Fed3RStatsParams, triu_unpack
from protocols.payloads.task_params import ModelSpec

from ops_fleet import kept_windows as kept

D, C = 5, 3


class Features:
    feature_dim = D

    def extract(self, x):
        return np.asarray(x, dtype=np.float32)


def data(n: int = 40, seed: int = 0):
    rng = np.random.default_rng(seed)
    return rng.normal(size=(n, D)).astype(np.float32), rng.integers(0, C, n)


def device(x, y, windows: SampleWindowLedger | None = None) -> Fed3RStatsTask:
    if windows is None:                 # no state folder (--no-state; tests/test_sample_windows_closed.py)
        return Fed3RStatsTask(x, y, lambda *a: Features())
    return Fed3RStatsTask(x, y, lambda *a: Features(), windows=windows)


def params(**window) -> dict:
    return Fed3RStatsParams(model=ModelSpec(backbone="precomputed", image_size=1, num_classes=C), format="dense",
                            **window).to_params()


def ask(handler, **window):
    """A and B (dense, float64) of the window the task names."""
    body, tensors = handler(params(**window))
    p = body["p"]
    return triu_unpack(np.asarray(tensors["A_upper"], dtype=np.float64), p), np.asarray(tensors["b"], dtype=np.float64)


def capped(first: int, count: int) -> dict:
    return {"from_sample": first, "max_samples": count, "cap_samples": True}


def reconstruct(A1, B1, A2, B2):
    """One sample from two answers one sample apart: ΔA = z zᵀ, ΔB = e_y zᵀ (z = [x, 1])."""
    dA, dB = A1 - A2, B1 - B2
    label = int(np.argmax(np.abs(dB).sum(axis=1)))
    z = dB[label]
    assert np.allclose(np.outer(z, z), dA, atol=1e-9)      # the Gram matrix agrees: it is one sample
    return z[:D], label


# the aggregator's choices of two windows one sample apart: where it starts, where the cap ends it
ONE_APART = {"from_sample": ({"from_sample": 11}, {"from_sample": 12}, 11),
             "cap_samples": ({**capped(0, 21)}, {**capped(0, 20)}, 20),
             "both": ({**capped(16, 10)}, {**capped(17, 9)}, 16)}


@pytest.mark.parametrize("choice", sorted(ONE_APART))
def test_two_windows_one_sample_apart_reveal_it_without_the_rule(choice, tmp_path):
    """The finding, shown: with the rule off the difference is the device's sample k, features and label."""
    x, y = data()
    first, second, k = ONE_APART[choice]
    handler = device(x, y, kept(tmp_path, min_difference=1))
    features, label = reconstruct(*ask(handler, **first), *ask(handler, **second))
    assert label == y[k]
    np.testing.assert_allclose(features, x[k].astype(np.float64), rtol=1e-9, atol=1e-9)


@pytest.mark.parametrize("choice", sorted(ONE_APART))
def test_the_second_window_one_sample_apart_is_declined(choice, tmp_path):
    x, y = data()
    first, second, _ = ONE_APART[choice]
    handler = device(x, y, kept(tmp_path))
    ask(handler, **first)
    with pytest.raises(TaskDeclined, match=f"differenced down to fewer than {MIN_DIFFERENCE} samples"):
        ask(handler, **second)
    ask(handler, **first)                                   # the same window again: a re-run, answered


def test_a_sum_of_answers_cannot_isolate_a_sample_either(tmp_path):
    """[0, 10), [10, 20) and [0, 21) differ pairwise by 11 samples, yet the third less the first two
    is sample 20: a rule on pairs lets it through, the boundary rule does not."""
    x, y = data()
    off = device(x, y, kept(tmp_path / "off", min_difference=1))
    A1, B1 = ask(off, **capped(0, 10))
    A2, B2 = ask(off, **capped(10, 10))
    A3, B3 = ask(off, **capped(0, 21))
    features, label = reconstruct(A3, B3, A1 + A2, B1 + B2)
    assert label == y[20] and np.allclose(features, x[20], atol=1e-9)

    handler = device(x, y, kept(tmp_path))
    ask(handler, **capped(0, 10))
    ask(handler, **capped(10, 10))
    with pytest.raises(TaskDeclined, match="boundary at 21 lies 1 sample"):
        ask(handler, **capped(0, 21))
    ask(handler, **capped(0, 30))                          # 30 is 10 from 20: a union of 8+ sample blocks


def test_a_window_of_fewer_samples_than_the_rule_is_declined_but_from_the_first_sample_first(tmp_path):
    """A first answer from sample 0 is what a job capping devices at e samples asks (DP with
    max_samples = 1 included): answered; any other small window is declined, first or not."""
    x, y = data()
    with pytest.raises(TaskDeclined, match="boundary at 40 lies 1 sample"):
        ask(device(x, y, kept(tmp_path)), from_sample=39)     # the last sample alone
    handler = device(x, y, kept(tmp_path))
    ask(handler, **capped(0, 1))
    ask(handler, **capped(0, 1))
    with pytest.raises(TaskDeclined, match="boundary at 2 lies 1 sample"):
        ask(handler, **capped(0, 2))                      # [0, 2) less [0, 1): sample 1


def test_a_small_devices_first_answer_over_all_its_data_is_answered_and_then_bounds_it(tmp_path):
    x, y = data(5)
    handler = device(x, y, kept(tmp_path))
    ask(handler)                                          # all 5 samples: what plain Fed3R shows by design
    ask(handler)
    handler.add_samples(*data(3, seed=1))
    with pytest.raises(TaskDeclined, match="boundary at 8 lies 3 sample"):
        ask(handler)                                      # [0, 8) less [0, 5): three samples
    with pytest.raises(TaskDeclined, match="differenced"):
        ask(handler, from_sample=5)
    handler.add_samples(*data(MIN_DIFFERENCE, seed=2))
    ask(handler, from_sample=5)                           # 5 + 3 + 8 = 16: 11 new since 5


def test_honest_streaming_increments_and_caps_are_answered(tmp_path):
    """Streaming asks [c, n) from its count c (a kept boundary); an increment of fewer than
    MIN_DIFFERENCE new samples is declined until enough have gathered; a DP job's cap is the same
    window every round."""
    x, y = data(12)
    handler = device(x, y, kept(tmp_path / "streaming"))
    ask(handler, from_sample=0)
    handler.add_samples(*data(3, seed=1))
    with pytest.raises(TaskDeclined, match="lies 3 sample"):
        ask(handler, from_sample=12)
    handler.add_samples(*data(6, seed=2))
    ask(handler, from_sample=12)
    ask(handler, from_sample=12)                          # a redelivery of that increment
    assert handler.windows.boundaries == [0, 12, 21]
    dp = device(*data(), kept(tmp_path))
    for _ in range(3):
        ask(dp, **capped(0, 10))                          # DP: [0, 10) each round
    assert dp.windows.boundaries == [0, 10]


def test_the_windows_survive_a_restart_in_the_state_folder(tmp_path):
    from edge_client.handlers import HandlerConfig, LocalData, device_handlers
    from edge_client.state import DeviceStateStore
    from protocols.payloads.fed3r import KIND

    x, y = data()
    def handlers():                     # the device as `fedfleet device --state-dir` builds it, after each restart
        local = LocalData(x, y, np.arange(len(y)), None)
        return device_handlers(local, lambda *a, **k: Features(), HandlerConfig(), state=DeviceStateStore(tmp_path))[KIND]

    ask(handlers(), **capped(0, 20))
    with pytest.raises(TaskDeclined, match="boundary at 21 lies 1 sample"):
        ask(handlers(), **capped(0, 21))
    ask(handlers(), **capped(0, 20))
    DeviceStateStore(tmp_path).forget()                   # job state, not the guard of the data
    with pytest.raises(TaskDeclined, match="boundary at 19 lies 1 sample"):
        ask(handlers(), **capped(0, 19))
    assert (tmp_path / WINDOWS_FILE).read_text() == '{"boundaries":[0,20]}'


def test_a_window_that_cannot_be_written_down_is_not_answered(tmp_path):
    x, y = data()
    ledger = SampleWindowLedger(tmp_path / "gone" / WINDOWS_FILE)      # its folder does not exist
    with pytest.raises(TaskDeclined, match="could not write down the sample window \\[0, 20\\)"):
        ask(device(x, y, ledger), **capped(0, 20))
    assert ledger.boundaries == [0]
    assert not list(tmp_path.iterdir())


@pytest.mark.parametrize("text", ['{"boundaries":[0,5,3]}', '{"boundaries":[1,9]}', '{"boundaries":[0,true]}',
                                  '{"boundaries":[0,8],"x":1}', '[0,8]', '{"boundaries":[0,8]', "\xff",
                                  '{"boundaries":[0,NaN]}', '{"boundaries":[0,8.0]}',
                                  '{"boundaries":[' + ",".join(map(str, range(MAX_BOUNDARIES + 1))) + "]}"])
def test_an_unreadable_file_is_refused_whole_with_a_warning(tmp_path, caplog, text):
    """Refused whole, and the ledger is lost: every window declined (the first answer from 0 too:
    tests/test_sample_windows_closed.py), the file left as it is."""
    path = tmp_path / WINDOWS_FILE
    path.write_bytes(text.encode("utf-8", "surrogateescape") if text != "\xff" else b"\xff")
    before = path.read_bytes()
    with caplog.at_level(logging.WARNING, logger="fedfleet.device"):
        ledger = SampleWindowLedger(path)
    assert ledger.lost is not None
    assert "sample windows" in caplog.text and "unreadable" in caplog.text and str(path) in caplog.text
    for window in ((0, 40, 40), (0, 1, 40), (0, 8, 40)):
        assert ledger.record(*window) == ledger.refusal(*window) == LOST_REASON
    assert path.read_bytes() == before


def test_a_fifo_in_the_files_place_does_not_block(tmp_path, caplog):
    path = tmp_path / WINDOWS_FILE
    os.mkfifo(path)
    with caplog.at_level(logging.WARNING, logger="fedfleet.device"):
        assert SampleWindowLedger(path).refusal(0, 40, 40) == LOST_REASON
    assert "not a regular file" in caplog.text


def test_the_ledger_is_bounded_and_never_forgets(tmp_path):
    # kept by an earlier run (a write per boundary would take the test half a minute)
    (tmp_path / WINDOWS_FILE).write_text(json.dumps({"boundaries": list(range(MAX_BOUNDARIES - 1))}))
    ledger = kept(tmp_path, min_difference=1)
    assert ledger.record(0, MAX_BOUNDARIES - 1, 10**5) is None
    assert len(ledger.boundaries) == MAX_BOUNDARIES
    assert "its most" in ledger.refusal(0, 10**5, 10**5)
    assert ledger.refusal(3, 7, 10**5) is None            # on kept boundaries: answered


def test_min_difference_is_checked():
    for bad in (0, -1, True, 2.5):
        with pytest.raises(ValueError, match="min_difference"):
            SampleWindowLedger(min_difference=bad)


# one device's tasks, in order: the window each asks and whether the rule answers it (kept: 0, then ...)
SCRIPT = [(capped(0, 20), True), (capped(0, 21), False), (capped(0, 10), True), (capped(10, 10), True),
          ({"from_sample": 36}, False), ({"from_sample": 29}, True), (capped(0, 21), False), ({}, True),
          (capped(0, 25), False), (capped(0, 15), False), ({"from_sample": 10}, True)]


def test_the_java_device_keeps_the_same_windows_by_the_same_rule(tmp_path):
    """Both devices get the same tasks, each run by a fresh device on its state folder (a restart
    before every task): the same answers and declines, word for word, and the same file."""
    import subprocess

    import java_build
    from test_java_device import write_features
    from java_tasks import task_bytes

    if java_build.missing() is not None:
        pytest.skip(java_build.missing())
    cp = java_build.built()
    x, y = data(37, seed=4)
    feats = write_features(tmp_path / "f.feat", x, y)
    java_state, python_state = tmp_path / "java", tmp_path / "python"
    python_state.mkdir()
    for step, (window, answered) in enumerate(SCRIPT):
        (tmp_path / "task.bin").write_bytes(task_bytes(params(**window), {}, "fed3r.stats"))
        proc = subprocess.run(java_build.java_command("-cp", cp, "TaskRunner", str(tmp_path / "task.bin"), str(feats),
                                                      str(tmp_path / "result.bin"), "-", str(java_state)),
                              capture_output=True, text=True, timeout=120)
        assert proc.returncode == 0, proc.stderr[-3000:]
        python = device(x, y, SampleWindowLedger(python_state / WINDOWS_FILE))
        try:
            python(params(**window))
            said = "DONE"
        except TaskDeclined as exc:
            said = f"DECLINED {exc}"
        assert proc.stdout.strip() == said, (step, window)
        assert said.startswith("DONE") == answered, (step, said)
    kept = [json.loads((folder / WINDOWS_FILE).read_text()) for folder in (java_state, python_state)]
    assert kept[0] == kept[1] == {"boundaries": [0, 10, 20, 29, 37]}


def test_a_curious_aggregators_second_window_is_declined_over_mosquitto(broker, tmp_path):
    """The wire path: a streaming Fed3R job turned curious asks the device again from its second
    sample ([1, 20) after [0, 20): sample 0 by difference); the device's agent declines with the
    rule's reason, which the aggregator records, and nothing more of the device is applied."""
    import dataclasses

    from aggregator.jobs.fed3r import Fed3RConfig, Fed3RJob
    from aggregator.storage.store import Store
    from ops_fleet import serve_until_done
    from protocols.payloads.fed3r import KIND

    class CuriousJob(Fed3RJob):
        def stats_task(self, device):
            params, tensors = super().stats_task(device)
            return dataclasses.replace(params, from_sample=1 if self.contributed.get(device) else 0), tensors

    config = Fed3RConfig(num_classes=C, feature_dim=D, lam=0.5, streaming=True, clients_per_round=1, max_attempts=1,
                         round_timeout_s=20, expected_devices=1)
    store = Store(tmp_path / "s.db")
    x, y = data(20)
    _, result = serve_until_done(CuriousJob(config), broker.url, tmp_path,
                                 {"dev00": {KIND: device(x, y, kept(tmp_path / "dev00"))}}, store)
    assert result["state"] == "done" and result["contributed"] == {"dev00": 20}
    events = [e for r in (1, 2) for e in store.round_events(config.job_id, r)]
    assert any("samples [1, 20): a window boundary at 1 lies 1 sample(s) from the boundary 0" in (e["reason"] or "")
               for e in events), events
