"""The sample-window ledger fails closed (``edge_client/sample_windows.py``, "Lost" and "Unkept").

A device that could not read its ``sample_windows.json`` used to start from {0}: it forgot every
window it answered, and its first answer from sample 0 was exempt again, so an aggregator that got
[0, 20) before the file was damaged got [0, 19) after it: sample 19 by difference. A device without
a state folder forgot its windows at every restart in the same way. Now the first declines every
window until the operator repairs the file or moves it aside (the file is never written over), and
the second answers only a window of all its samples from the first. Both SDKs decide alike, word for
word; the decline crosses a real broker."""

from __future__ import annotations

import os
import shutil

import numpy as np
import pytest

from edge_client.agent import TaskDeclined
from edge_client.handlers import HandlerConfig, LocalData, device_handlers
from edge_client.sample_windows import LOST_REASON, WINDOWS_FILE, SampleWindowLedger
from edge_client.state import DeviceStateStore
from protocols.payloads.fed3r import KIND
from test_sample_windows import Features, ask, capped, data, device, params, reconstruct

N = 40


def restarted(folder, x, y):
    """The device's Fed3R handler as ``fedfleet device`` builds it at start (``--state-dir`` = folder, or none)."""
    local = LocalData(x, y, np.arange(len(y)), None)
    state = None if folder is None else DeviceStateStore(folder)
    return device_handlers(local, lambda *a, **k: Features(), HandlerConfig(), state=state)[KIND]


def unkept_words(start: int, end: int, samples: int) -> str:
    return f"samples \\[{start}, {end}\\) of {samples}: this device has no state folder \\(--state-dir\\)"


# what can stand in the ledger's place once the device answered [0, 20): each loses the ledger
DAMAGE = {"truncated": lambda p: p.write_bytes(p.read_bytes()[:-3]),
          "emptied": lambda p: p.write_bytes(b""),
          "a directory": lambda p: (p.unlink(), p.mkdir()),
          "a symlink loop": lambda p: (p.unlink(), p.symlink_to(p.name))}


@pytest.mark.parametrize("damage", sorted(DAMAGE))
def test_a_damaged_ledger_declines_every_window_after_a_restart(tmp_path, damage):
    """[0, 20) answered; the file damaged; the restarted device is asked [0, 19), which less the
    first answer is sample 19. Declined, as is every other window (the first answer from 0, all its
    data), and the damaged file is left as it is."""
    x, y = data(N)
    first = ask(restarted(tmp_path, x, y), **capped(0, 20))
    path = tmp_path / WINDOWS_FILE
    DAMAGE[damage](path)
    left = path.read_bytes() if path.is_file() else None
    handler = restarted(tmp_path, x, y)
    for window in (capped(0, 19), capped(0, 20), {}, capped(0, 1), {"from_sample": 20}):
        with pytest.raises(TaskDeclined) as declined:
            ask(handler, **window)
        assert str(declined.value) == LOST_REASON, window
    assert (path.read_bytes() if path.is_file() else None) == left and path.is_symlink() == (damage == "a symlink loop")
    # what the decline withholds: the two answers give sample 19, features and label
    rule_off = device(x, y, SampleWindowLedger(tmp_path / "rule_off.json", 1))
    features, label = reconstruct(*first, *ask(rule_off, **capped(0, 19)))
    assert label == y[19] and np.allclose(features, x[19], atol=1e-6)


def test_the_operator_recovers_by_moving_the_file_aside(tmp_path):
    """The documented recovery: the damaged file moved aside (kept for a look), the device restarted
    with a fresh ledger. A missing file is a fresh device, as it always was."""
    x, y = data(N)
    (tmp_path / WINDOWS_FILE).write_text('{"boundaries":[0,20')
    with pytest.raises(TaskDeclined, match="moves it aside"):
        ask(restarted(tmp_path, x, y), **capped(0, 20))
    shutil.move(tmp_path / WINDOWS_FILE, tmp_path / "sample_windows.json.damaged")
    handler = restarted(tmp_path, x, y)
    ask(handler, **capped(0, 20))
    assert (tmp_path / WINDOWS_FILE).read_text() == '{"boundaries":[0,20]}'
    assert (tmp_path / "sample_windows.json.damaged").read_text() == '{"boundaries":[0,20'


def test_a_lost_ledger_serves_again_once_repaired_or_moved_aside_without_a_restart(tmp_path, caplog):
    """The same running device: its damaged file repaired, it answers by the repaired boundaries
    (a window too near one of them still declined); moved aside, it is a fresh device. The warning
    is logged once per reason, not at every task (each task reads the file again)."""
    x, y = data(N)
    path = tmp_path / WINDOWS_FILE
    path.write_text('{"boundaries":[0,20')
    handler = restarted(tmp_path, x, y)
    for _ in range(3):
        with pytest.raises(TaskDeclined, match="moves it aside"):
            ask(handler, **capped(0, 20))
    assert sum("are unreadable" in r.getMessage() for r in caplog.records) == 1
    path.write_text('{"boundaries":[0,20]}')                   # repaired by the operator
    with pytest.raises(TaskDeclined, match="lies 1 sample"):
        ask(handler, **capped(0, 19))                           # [0, 19) beside the kept 20: still declined
    ask(handler, **capped(0, 30))
    assert path.read_text() == '{"boundaries":[0,20,30]}'
    path.write_text("damaged again")                            # found at the next start
    handler = restarted(tmp_path, x, y)
    with pytest.raises(TaskDeclined, match="moves it aside"):
        ask(handler, **capped(0, 30))
    shutil.move(path, tmp_path / "sample_windows.json.damaged")
    ask(handler, **capped(0, 10))                               # a fresh ledger: its first answer
    assert path.read_text() == '{"boundaries":[0,10]}'


def test_an_unreadable_ledger_is_lost_not_fresh(tmp_path):
    """A file the device may not open is not a missing one."""
    if os.geteuid() == 0:
        pytest.skip("root opens a file of mode 000")
    path = tmp_path / WINDOWS_FILE
    path.write_text('{"boundaries":[0,20]}')
    path.chmod(0)
    assert SampleWindowLedger(path).refusal(0, 19, N) == LOST_REASON


def test_without_a_state_folder_only_all_samples_from_the_first_are_answered():
    """[0, 20) before a restart and [0, 19) after it would give sample 19: without a state folder
    neither is answered; all 40 samples are, at every restart (the same answer). Streaming
    increments are declined too. The bare task's default ledger is the same."""
    x, y = data(N)
    for handler in (restarted(None, x, y), device(x, y)):
        whole = ask(handler)
        np.testing.assert_array_equal(ask(handler, **capped(0, 50))[0], whole[0])   # a cap over all: the same window
        with pytest.raises(TaskDeclined, match=unkept_words(0, 20, N) + ".* answers only a window of all its samples"):
            ask(handler, **capped(0, 20))
        with pytest.raises(TaskDeclined, match=unkept_words(0, 19, N)):
            ask(restarted(None, x, y), **capped(0, 19))
        with pytest.raises(TaskDeclined, match=unkept_words(20, N, N)):
            ask(handler, from_sample=20)
        np.testing.assert_array_equal(ask(restarted(None, x, y))[0], whole[0])


def test_without_a_state_folder_the_rule_still_holds_in_the_process():
    """Data appended between two answers: [0, 40) then [0, 43) is declined (3 samples), [0, 48) answered."""
    x, y = data(N)
    handler = device(x, y)
    ask(handler)
    handler.add_samples(*data(3, seed=1))
    with pytest.raises(TaskDeclined, match="boundary at 43 lies 3 sample"):
        ask(handler)
    handler.add_samples(*data(5, seed=2))
    ask(handler)


# (what the state folder holds before the task, the task's window): a fresh JVM and a fresh Python
# device for each, on the same data
JAVA_CASES = [(None, {}), (None, capped(0, 20)), (None, {"from_sample": 8}), (None, capped(0, 99)),
              ('{"boundaries":[0,20]', capped(0, 19)), ('{"boundaries":[0,20]', {}), ("", capped(0, 1)),
              ('{"boundaries":[0,3,2]}', capped(0, 20)), ("a directory", {}), ('{"boundaries":[0,20]}', capped(0, 28))]


def test_the_java_device_fails_closed_alike(tmp_path):
    """The Java device (TaskRunner: a device of one task, with a state folder or none) and the
    Python device give the same answers and declines, word for word, and leave the file alone."""
    import subprocess

    import java_build
    from test_java_device import write_features
    from java_tasks import task_bytes

    if java_build.missing() is not None:
        pytest.skip(java_build.missing())
    cp = java_build.built()
    x, y = data(N, seed=3)
    feats = write_features(tmp_path / "f.feat", x, y)
    for step, (kept, window) in enumerate(JAVA_CASES):
        folders = [tmp_path / f"{sdk}{step}" for sdk in ("java", "python")]
        for folder in folders:
            folder.mkdir()
            if kept == "a directory":
                (folder / WINDOWS_FILE).mkdir()
            elif kept is not None:
                (folder / WINDOWS_FILE).write_text(kept)
        (tmp_path / "task.bin").write_bytes(task_bytes(params(**window), {}, "fed3r.stats"))
        state = [] if kept is None else ["-", str(folders[0])]
        proc = subprocess.run(java_build.java_command("-cp", cp, "TaskRunner", str(tmp_path / "task.bin"), str(feats),
                                                  str(tmp_path / "result.bin"), *state), capture_output=True, text=True, timeout=120)
        assert proc.returncode == 0, proc.stderr[-3000:]
        python = device(x, y, None if kept is None else SampleWindowLedger(folders[1] / WINDOWS_FILE))
        try:
            python(params(**window))
            said = "DONE"
        except TaskDeclined as exc:
            said = f"DECLINED {exc}"
        assert proc.stdout.strip() == said, (step, kept, window)
        if kept not in (None, "a directory"):        # left as it was, or (a window answered) written alike
            written = '{"boundaries":[0,20,28]}' if said == "DONE" else kept
            assert [(f / WINDOWS_FILE).read_text() for f in folders] == [written] * 2, step


# one running device's ledger, lost at start: repaired by the operator, it serves (and a file moved aside
# while the ledger is sound changes nothing: the running device keeps its windows and writes them anew);
# moved aside while lost, a fresh ledger
RECOVERY_STEPS = {"repaired": ["refusal:0:20:40", "refusal:0:20:40", "write:{\"boundaries\":[0,20]}",
                               "refusal:0:19:40", "record:0:30:40", "move", "record:0:10:40", "refusal:0:11:40"],
                  "moved aside": ["refusal:0:20:40", "move", "record:0:10:40", "refusal:0:11:40"]}


def python_windows_script(path, steps: list[str]) -> list[str]:
    """RECOVERY_STEPS on a SampleWindowLedger kept in ``path`` (None: no state folder), as TaskRunner
    --windows runs them on SampleWindows ("restart": a fresh ledger on the same file)."""
    ledger, said = SampleWindowLedger(path), []
    for step in steps:
        what, _, rest = step.partition(":")
        if what == "restart":
            ledger = SampleWindowLedger(path)
        elif what == "write":
            path.write_text(rest)
        elif what == "move":
            shutil.move(path, f"{path}.damaged")
        else:
            reason = getattr(ledger, what)(*map(int, rest.split(":")))
            said.append("OK" if reason is None else reason)
    return said


@pytest.mark.parametrize("how", RECOVERY_STEPS)
def test_the_java_device_recovers_a_lost_ledger_without_a_restart_alike(how, tmp_path):
    """Both SDKs read a lost ledger again at every window asked: repaired, it serves by its
    boundaries; moved aside, it is fresh; the same words at every step, and the same file."""
    import java_build
    from java_tasks import java

    if java_build.missing() is not None:
        pytest.skip(java_build.missing())
    files = {sdk: tmp_path / sdk / WINDOWS_FILE for sdk in ("java", "python")}
    for path in files.values():
        path.parent.mkdir()
        path.write_text('{"boundaries":[0,20')
    steps = RECOVERY_STEPS[how]
    said_java = java(java_build.built(), "--windows", files["java"], *steps).splitlines()
    said_python = python_windows_script(files["python"], steps)
    assert said_java == said_python
    assert said_python[0] == LOST_REASON and "lies 1 sample" in said_python[-1]
    if how == "repaired":
        assert said_python[1] == LOST_REASON and "lies 1 sample" in said_python[2] and said_python[3:5] == ["OK"] * 2
        written = '{"boundaries":[0,10,20,30]}'
    else:
        assert said_python[1] == "OK"
        written = '{"boundaries":[0,10]}'
    assert [p.read_text() for p in files.values()] == [written] * 2


def test_a_device_with_a_damaged_ledger_declines_over_mosquitto(broker, tmp_path):
    """Over the wire: a Fed3R job of two devices (``fedfleet device --state-dir`` handlers); one's
    ledger file is damaged. It declines with the ledger's reason, which the aggregator records; the
    other device's statistics make the job."""
    from aggregator.jobs.fed3r import Fed3RConfig, Fed3RJob
    from aggregator.storage.store import Store
    from ops_fleet import serve_until_done

    config = Fed3RConfig(num_classes=3, feature_dim=5, lam=0.5, clients_per_round=2, max_attempts=1,
                         round_timeout_s=20, expected_devices=2)
    store = Store(tmp_path / "s.db")
    handlers = {}
    for i, dev in enumerate(("dev00", "dev01")):
        (tmp_path / dev).mkdir()
        if dev == "dev00":
            (tmp_path / dev / WINDOWS_FILE).write_text('{"boundaries":[0,2')
        handlers[dev] = {KIND: restarted(tmp_path / dev, *data(20, seed=i))}
    _, result = serve_until_done(Fed3RJob(config), broker.url, tmp_path, handlers, store)
    assert result["contributed"] == {"dev01": 20}, result
    events = [e for r in (1, 2) for e in store.round_events(config.job_id, r)]
    assert any(e["device"] == "dev00" and e["reason"] == LOST_REASON for e in events), events
    assert (tmp_path / "dev00" / WINDOWS_FILE).read_text() == '{"boundaries":[0,2'
