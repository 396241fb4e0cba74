"""The device's round machine, Python and Java, against the same golden traces (issue 36): every
recorded event sequence in protocols/golden/traces/ is replayed through protocols.device_session'
DeviceSession and the Java library's DeviceSession; each must answer every event with the recorded
actions and state, and end with the same memory() (what a device keeps across restarts in
session.json). The traces must fire every row of DEVICE_TABLE in every state it names, so no
rule of the table goes untried on the Java side. Both sessions take back the same memories and
refuse the same malformed ones (recall)."""

from __future__ import annotations

import json
import logging
import os
import subprocess

import pytest

import java_build
from edge_client.session_memory import MAX_MEMORY_BYTES, SessionMemoryFile
from protocols.golden_traces import SESSION, TRACE_DIR, replay, traces
from protocols.device_session import DEVICE_TABLE, MAX_JOBS_REMEMBERED, DeviceSession

TRACES = sorted(TRACE_DIR.glob("*.json"))


def recorded(path) -> dict:
    return json.loads(path.read_text())


def test_the_recorded_traces_are_the_ones_the_module_defines():
    assert {p.stem for p in TRACES} == set(traces()), "stale: run `python -m protocols.golden_traces`"
    for path in TRACES:
        trace = recorded(path)
        assert trace["session"] == SESSION and [s["event"] for s in trace["steps"]] == traces()[path.stem]


@pytest.mark.parametrize("path", TRACES, ids=lambda p: p.stem)
def test_python_answers_every_event_as_recorded(path):
    trace = recorded(path)
    assert replay(trace["session"], [s["event"] for s in trace["steps"]]) == trace["steps"]


def test_the_traces_fire_every_device_row_in_every_state_it_names():
    fired = set()
    for path in TRACES:
        trace = recorded(path)
        replay(trace["session"], [s["event"] for s in trace["steps"]],
               on_event=lambda machine, event: fired.add((machine.state, DEVICE_TABLE.select(machine, event))))
    names = lambda pairs: {(state.name, DEVICE_TABLE.describe(row)) for state, row in pairs}
    assert names(DEVICE_TABLE.entries()) - names(fired) == set()


@pytest.mark.skipif(java_build.missing() is not None, reason=str(java_build.missing()))
def test_java_answers_every_event_as_recorded():
    proc = subprocess.run(java_build.java_command("-cp", java_build.built(), "org.fedfleet.device.SessionTraces",
                                                  *map(str, TRACES)),
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    lines = {line["trace"]: line for line in map(json.loads, proc.stdout.splitlines())}
    answers = {name: line["steps"] for name, line in lines.items()}
    assert sorted(answers) == [p.name for p in TRACES]
    for path in TRACES:
        want = [{"actions": s["actions"], "state": s["state"]} for s in recorded(path)["steps"]]
        for i, (got, expected) in enumerate(zip(answers[path.name], want, strict=True)):
            assert got == expected, f"{path.stem} step {i} ({recorded(path)['steps'][i]['event']}): Java {got}"
        machines = []
        replay(recorded(path)["session"], [s["event"] for s in recorded(path)["steps"]],
               on_event=lambda machine, event: machines.append(machine))
        python = machines[-1]
        assert (lines[path.name]["memory"], lines[path.name]["memory_changes"]) == (python.memory(), python.memory_changes), path.stem


NOW = 1.8e9          # the device's clock the memories are read by (unix seconds)
GRACE = DeviceSession().deadline_grace_s


def session_memories() -> tuple[dict, list, list]:
    """A valid memory, then memories either device may find in its session.json: the ones taken
    back, the ones refused whole."""
    base = {"version": 1, "started": [["b", 1, "bt", 5.0]], "expired_declined": ["b"]}
    entry = lambda job, r=2, task="t", ts=7.5: {**base, "started": [[job, r, task, ts]]}
    many = {"version": 1, "started": [[f"j{i}", i, f"t{i}", i + 0.5] for i in range(MAX_JOBS_REMEMBERED + 10)],
            "expired_declined": [f"j{i}" for i in range(MAX_JOBS_REMEMBERED + 10)]}
    ids = [f"d{i}" for i in range(MAX_JOBS_REMEMBERED)]
    taken = [
        {"version": 1, "started": [], "expired_declined": []}, many, {**base, "extra": [1]},
        {**base, "started": [["a", 1, "t1", 1.0], ["b", 2, "t2", 2], ["a", 3, "t3", 3.0]]},   # a job twice: the later
        entry("é" * 256), entry("\U0001F600" * 256), entry("j", -(1 << 62)), entry("j", (1 << 62) - 1), entry("j", ts=-1e300),
        {**base, "expired_declined": [*ids, ids[0]]}, {**base, "expired_declined": [*ids, ids[5], "x", ids[7]]},  # twice: first place
        # by the device's clock (recall(memory, now)): a start later than now + grace forgotten, at it kept
        {**base, "started": [["f", 9, "t9", NOW + GRACE + 0.001], ["g", 2, "t2", NOW + GRACE], ["h", 1, "t1", NOW - 5],
                             ["k", 1, "t1", NOW + 1e9]], "expired_declined": ["f"]},
        {**base, "started": [["a", 1, "t1", NOW - 5], ["a", 2, "t2", NOW + 3600]]},      # its later entry, forgotten: none
        {**many, "started": [*many["started"], *([f"z{i}", 1, "t", NOW + 3600] for i in range(10))]},   # forgotten, then 64 kept
        {**base, "started": [["m", 1, "t", 1e308], ["n", 1, "t", 2.0 ** 64 - 1], ["o", 1, "t", -0.0]]},
        # the jobs whose last start was answered: one not among the starts ignored, one twice once;
        # a start forgotten by the clock takes its mark with it
        {**base, "answered": ["b"]}, {**base, "answered": ["zz", "b", "b"]}, {**base, "answered": []},
        {**base, "started": [["f", 9, "t9", NOW + 3600], ["g", 2, "t2", NOW - 5]], "answered": ["g", "f"]},
        {**many, "answered": [f"j{i}" for i in range(0, MAX_JOBS_REMEMBERED + 10, 3)]}]
    refused = [
        None, [], "session", {**base, "version": 2}, {**base, "version": 1.0}, {**base, "version": True},
        {"started": [], "expired_declined": []}, {**base, "started": {}}, {**base, "expired_declined": None},
        {**base, "started": [["j", 2, "t"]]}, {**base, "started": [["j", 2, "t", 1.0, 0]]}, entry("j", 2.0), entry("j", True),
        entry("j", "2"), entry("j", 1 << 62), entry("j", -(1 << 62) - 1), entry("j", 1 << 64), entry("j", ts=float("nan")),
        entry("j", ts=float("inf")), entry("j", ts=10 ** 400), entry("j", ts="7.5"), entry("j", ts=None), entry("j", ts=True),
        entry(""), entry("j" * 257), entry("\U0001F600" * 257), entry(3), entry("j", task=""), entry("j", task=["t"]),
        {**base, "expired_declined": [""]}, {**base, "expired_declined": ["x" * 257]}, {**base, "expired_declined": [["b"]]},
        # every entry is checked, not only the newest MAX_JOBS_REMEMBERED
        {**many, "started": [["bad"], *many["started"]]}, {**many, "expired_declined": [3, *many["expired_declined"]]},
        {**many, "started": [["old", 1, "t", float("nan")], *many["started"]]},
        {**base, "started": [["f", 1, "t", NOW + 3600], ["j", 1, "t", "late"]]},     # a future entry is no excuse
        {**base, "answered": None}, {**base, "answered": "b"}, {**base, "answered": {"b": True}}, {**base, "answered": [3]},
        {**base, "answered": [""]}, {**base, "answered": ["x" * 257]}, {**base, "answered": [["b"]]},
        {**base, "answered": ["b", True]}]
    return base, taken, refused


@pytest.mark.skipif(java_build.missing() is not None, reason=str(java_build.missing()))
@pytest.mark.parametrize("now", [None, NOW], ids=["no clock", "by the clock"])
def test_java_recalls_and_refuses_session_memories_as_python_does(now):
    """What DeviceSession.recall (Java) and protocols/rounds.py's recall take back from a session.json:
    the same memory, or the same refusal, which leaves the session as it was; with the device's
    clock, the same starts in its future forgotten."""
    base, taken, refused = session_memories()
    lines = [json.dumps(base), *map(json.dumps, taken + refused), '{"version": 1, "started": [', "{'version': 1}"]   # torn, not JSON
    proc = subprocess.run(java_build.java_command("-cp", java_build.built(), "org.fedfleet.device.SessionTraces",
                                                  "--recall", *([] if now is None else [repr(now)])),
                          input="\n".join(lines) + "\n", capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    java = proc.stdout.splitlines()
    assert len(java) == len(lines) - 1
    forgotten = 0
    for text, got in zip(lines[1:], java):
        session = DeviceSession()
        session.recall(base)
        try:
            memory = json.loads(text)
            session.recall(memory, now)
            python_refused = False
            forgotten += len({e[0] for e in memory["started"]}) - len(session.last_started)
        except ValueError:          # json's errors too
            python_refused = True
        python = {"refused": python_refused, "memory": session.memory(), "memory_changes": session.memory_changes}
        # as text: 1 and 1.0, 0.0 and -0.0 told apart
        assert got == json.dumps(python, sort_keys=True, separators=(",", ":")), text[:300]   # recall is no change to write
    assert [json.loads(got)["refused"] for got in java] == [False] * len(taken) + [True] * (len(refused) + 2)
    assert forgotten > 0 if now is not None else True     # the future entries were there to forget


# ---- the file itself: both devices' readers on the same bytes ----------------------------------
def _memory_text(started=(("j", 3, "t", NOW - 10),), declined=("j",), extra="") -> str:
    text = lambda s: json.dumps(s, ensure_ascii=False)      # raw UTF-8, as the devices write it
    return ('{"version": 1, "started": [' + ", ".join(f"[{text(j)}, {r}, {text(t)}, {ts}]" for j, r, t, ts in started)
            + '], "expired_declined": [' + ", ".join(map(text, declined)) + "]" + extra + "}")


def _with_ts(ts: str) -> str:
    return _memory_text(started=(("j", 3, "t", ts),))


def session_files() -> list[tuple[str, object, bool]]:
    """(name, what lies at the path, whether a device takes it): bytes, or "dir", "fifo", "missing",
    ("link", name). Files neither device wrote: what the strict reader must refuse (or take) alike."""
    valid = _memory_text()
    task_id = lambda token: valid.replace('"t"', token)         # the started entry's task id, as JSON text
    u8 = lambda text: text.encode("utf-8")
    many = lambda bad=None, bad_declined=None: _memory_text(
        started=[*([bad] if bad is not None else []), *((f"j{i}", i, f"t{i}", NOW - 100 + i) for i in range(MAX_JOBS_REMEMBERED + 6))],
        declined=[*([bad_declined] if bad_declined is not None else []), *(f"j{i}" for i in range(MAX_JOBS_REMEMBERED + 6))])
    nested = lambda n: _memory_text(extra=', "x": ' + "[" * n + "]" * n)
    emoji = "\U0001F600"
    big = str(7) * 5000
    padded = lambda size: valid.encode() + b" " * (size - len(valid.encode()))
    taken = [
        ("valid", u8(valid)), ("whitespace around", u8("\n\t \r" + valid + " \r\n\t")),
        ("the wire's extreme integers", u8(_memory_text(extra=', "x": [18446744073709551615, -9223372036854775808]'))),
        ("ts an integer", u8(_with_ts("1799999990"))), ("ts -0.0", u8(_with_ts("-0.0"))), ("ts -0", u8(_with_ts("-0"))),
        ("ts -1e308", u8(_with_ts("-1e308"))), ("ts 4.9e-324", u8(_with_ts("4.9e-324"))), ("ts 1e-400", u8(_with_ts("1e-400"))),
        ("ts 2^64 - 1 (future)", u8(_with_ts("18446744073709551615"))), ("ts -2^63", u8(_with_ts("-9223372036854775808"))),
        ("ts 1e308 (future)", u8(_with_ts("1e308"))), ("ts 1.7976931348623157e308", u8(_with_ts("1.7976931348623157e308"))),
        ("ts at now + grace", u8(_with_ts(repr(NOW + GRACE)))), ("ts past now + grace", u8(_with_ts(repr(NOW + GRACE + 0.001)))),
        ("ts 1.8E+9", u8(_with_ts("1.8E+9"))),
        ("ids of 256 non-BMP characters", u8(_memory_text(started=((emoji * 256, 1, emoji * 256, NOW),), declined=(emoji * 256,)))),
        ("ids of 256 escaped pairs", u8(_memory_text(started=((emoji * 256, 1, "t", NOW),), declined=(emoji * 256,))
                                         .replace(emoji, "\\ud83d\\ude00"))),
        ("id of 200 non-BMP characters", u8(_memory_text(declined=(emoji * 200,)))),
        ("escapes in an id", u8(task_id('"\\u00E9\\/\\"\\\\\\u0000\\t\\ud83d\\ude00"'))),
        ("an escaped key", u8(valid.replace('"version"', '"\\u0076ersion"'))),
        ("depth 32", u8(nested(31))), ("a job listed twice", u8(_memory_text(
            started=(("a", 1, "t1", NOW - 9), ("b", 1, "t", NOW - 8), ("a", 2, "t2", NOW - 7)), declined=("a", "b", "a")))),
        ("70 jobs, the newest 64 kept", u8(many())),
        ("64 declined and one twice", u8(_memory_text(declined=[*(f"d{i}" for i in range(64)), "d3"]))),
        ("exactly 320 KiB", padded(MAX_MEMORY_BYTES)), ("a link to a valid file", ("link", "valid")),
        ("a job answered", u8(_memory_text(extra=', "answered": ["j"]'))),
        ("an answered job not started", u8(_memory_text(extra=', "answered": ["zz", "j"]'))),
    ]
    refused = [
        ("duplicate key", u8(valid.replace('{"version": 1,', '{"version": 1, "version": 1,'))),
        ("duplicate key, nested", u8(_memory_text(extra=', "x": {"a": 1, "a": 1}'))),
        ("duplicate key, escaped", u8(valid.replace('{"version": 1,', '{"version": 1, "\\u0076ersion": 1,'))),
        ("ts NaN", u8(_with_ts("NaN"))), ("ts Infinity", u8(_with_ts("Infinity"))), ("ts -Infinity", u8(_with_ts("-Infinity"))),
        ("NaN elsewhere", u8(_memory_text(extra=', "x": NaN'))), ("1e400", u8(_memory_text(extra=', "x": 1e400'))),
        ("-1e400", u8(_memory_text(extra=', "x": -1e400'))), ("ts 1e400", u8(_with_ts("1e400"))),
        ("1.7976931348623159e308", u8(_memory_text(extra=', "x": 1.7976931348623159e308'))),
        ("2^64", u8(_memory_text(extra=', "x": 18446744073709551616'))),
        ("-2^63 - 1", u8(_memory_text(extra=', "x": -9223372036854775809'))),
        ("ts 2^64", u8(_with_ts("18446744073709551616"))), ("a 5000-digit integer", u8(_memory_text(extra=', "x": ' + big))),
        ("ts a -5000-digit integer", u8(_with_ts("-" + big))),
        ("a 250000-digit integer", u8(_memory_text(extra=', "x": ' + "9" * 250_000))),
        ("a byte order mark", b"\xef\xbb\xbf" + u8(valid)), ("UTF-16 with its mark", valid.encode("utf-16")),
        ("UTF-16-BE", valid.encode("utf-16-be")),
        ("a lone surrogate escaped", u8(task_id('"\\ud800"'))),
        ("a lone low surrogate escaped", u8(task_id('"x\\udc00"'))),
        ("a surrogate pair reversed", u8(task_id('"\\ude00\\ud83d"'))),
        ("a high surrogate before a letter", u8(task_id('"\\ud83d\\u0041"'))),
        ("a lone surrogate escaped in a declined job", u8(_memory_text(declined=("j",)).replace('["j"]', '["\\udfff"]'))),
        ("a lone surrogate in a key", u8(_memory_text(extra=', "\\udbff": 1'))),
        ("a lone surrogate raw", u8(valid).replace(b'"t"', b'"\xed\xa0\x80"')),
        ("CESU-8 pair", u8(valid).replace(b'"t"', b'"\xed\xa0\xbd\xed\xb8\x80"')),
        ("invalid UTF-8", u8(valid).replace(b'"t"', b'"\xff"')), ("overlong UTF-8", u8(valid).replace(b'"t"', b'"\xc0\xaf"')),
        ("truncated UTF-8", u8(valid).replace(b'"t"', b'"\xe2\x82"')),
        ("past U+10FFFF", u8(valid).replace(b'"t"', b'"\xf4\x90\x80\x80"')),
        ("Latin-1", valid.replace('"t"', '"é"').encode("latin-1")),
        ("depth 33", u8(nested(32))), ("depth 10000", u8(nested(10_000))),
        ("ids of 257 non-BMP characters", u8(_memory_text(started=((emoji * 257, 1, "t", NOW),), declined=()))),
        ("a task id of 257 non-BMP characters", u8(_memory_text(started=(("j", 1, emoji * 257, NOW),), declined=()))),
        ("a declined id of 257 non-BMP characters", u8(_memory_text(declined=(emoji * 257,)))),
        ("an id of 257 characters", u8(_memory_text(declined=("j" * 257,)))),
        ("ts true", u8(_with_ts("true"))), ("ts null", u8(_with_ts("null"))), ('ts "1.0"', u8(_with_ts('"1.0"'))),
        ("version 1.0", u8(valid.replace('"version": 1', '"version": 1.0'))),
        ("version true", u8(valid.replace('"version": 1', '"version": true'))),
        ('version "1"', u8(valid.replace('"version": 1', '"version": "1"'))),
        ("version 2", u8(valid.replace('"version": 1', '"version": 2'))),
        ("no version", u8(valid.replace('"version": 1, ', ""))),
        ("round 2^62", u8(valid.replace('"j", 3,', '"j", 4611686018427387904,'))),
        ("round 3.0", u8(valid.replace('"j", 3,', '"j", 3.0,'))),
        ("a directory", "dir"), ("a FIFO", "fifo"),
        ("empty", b""), ("whitespace only", b" \n"), ("torn", u8(valid)[: len(valid) // 2]), ("torn at its end", u8(valid)[:-1]),
        ("320 KiB and a byte", padded(MAX_MEMORY_BYTES + 1)),
        ("a bad entry older than the newest 64", u8(many(bad=("old", 1, "t", '"x"')))),
        ("a bad declined job older than the newest 64", u8(many(bad_declined=""))),
        ("a raw control character", u8(valid).replace(b'"t"', b'"\x01"')), ("a raw tab", u8(valid).replace(b'"t"', b'"\t"')),
        ("form feed around", b"\x0c" + u8(valid)), ("NBSP around", u8("\u00a0" + valid)),
        ("a trailing comma", u8(valid.replace('["j"]', '["j",]'))), ("trailing data", u8(valid + "x")),
        ("two values", u8(valid + " " + valid)), ("an array", u8("[" + valid + "]")), ("null", b"null"),
        ("ts 01", u8(_with_ts("01"))), ("ts 1.", u8(_with_ts("1."))), ("ts .5", u8(_with_ts(".5"))), ("ts +1", u8(_with_ts("+1"))),
        ("ts -", u8(_with_ts("-"))), ("ts 1e", u8(_with_ts("1e"))), ("ts -NaN", u8(_with_ts("-NaN"))),
        ("ts an Arabic-Indic digit", u8(_with_ts("\u0662"))),
        ("single quotes", u8(valid.replace('"', "'"))), ("a comment", u8("// session\n" + valid)),
        ("a short \\u escape", u8(valid.replace('"t"', '"\\u12"'))), ("a bad \\u escape", u8(valid.replace('"t"', '"\\u12g4"'))),
        ("a signed \\u escape", u8(valid.replace('"t"', '"\\u+061"'))), ("an \\x escape", u8(valid.replace('"t"', '"\\x41"'))),
        ("a \\U escape", u8(valid.replace('"t"', '"\\U0001F600"'))),
        ("answered null", u8(_memory_text(extra=', "answered": null'))),
        ("answered a job id and a number", u8(_memory_text(extra=', "answered": ["j", 1]'))),
        ("answered twice", u8(_memory_text(extra=', "answered": ["j"], "answered": ["j"]'))),
    ]
    return [(name, what, True) for name, what in taken] + [(name, what, False) for name, what in refused]


def lay_out(folder, files) -> list:
    """The cases' paths in `folder` ("missing": nothing there)."""
    paths = []
    for index, (name, what, _) in enumerate(files):
        path = folder / f"{index:03d}.json"
        if what == "dir":
            path.mkdir()
        elif what == "fifo":
            os.mkfifo(path)
        elif isinstance(what, tuple):
            path.symlink_to(paths[[n for n, _, _ in files].index(what[1])])
        else:
            path.write_bytes(what)
        paths.append(path)
    return paths


@pytest.mark.skipif(java_build.missing() is not None, reason=str(java_build.missing()))
def test_both_devices_read_the_same_session_files_alike(tmp_path, caplog):
    """The same session.json bytes through both devices' own readers (edge_client/session_memory.py's
    load_into, SessionMemoryFile.loadInto, by the same clock): the same memory taken, or both refuse
    the file whole with one warning; a missing file is no warning. One JVM reads every file."""
    files = [*session_files(), ("missing", "missing", False)]
    paths = lay_out(tmp_path, files[:-1]) + [tmp_path / "absent.json"]
    proc = subprocess.run(java_build.java_command("-cp", java_build.built(), "org.fedfleet.device.SessionTraces",
                                                  "--load-file", repr(NOW), *map(str, paths)),
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    java = proc.stdout.splitlines()
    assert len(java) == len(paths)
    caplog.set_level(logging.WARNING, logger="fedfleet.device")
    for (name, _, takes), path, got in zip(files, paths, java):
        session = DeviceSession()
        caplog.clear()
        loaded = SessionMemoryFile(path).load_into(session, now=NOW)
        warnings = sum(r.levelno == logging.WARNING for r in caplog.records)
        python = {"file": str(path), "loaded": loaded, "memory": session.memory(), "warnings": warnings}
        assert got == json.dumps(python, sort_keys=True, separators=(",", ":")), f"{name}: Java {got[:300]}"
        assert (loaded, warnings) == ((True, 0) if takes else (False, 0 if name == "missing" else 1)), name
        if not takes:
            assert session.memory() == DeviceSession().memory(), name


@pytest.mark.skipif(java_build.missing() is not None, reason=str(java_build.missing()))
def test_java_says_a_failed_write_once_and_tries_it_again_only_at_the_next_change(tmp_path):
    """SessionMemoryFile.saveIfChanged as save_if_changed (test_session_memory.py): one warning per
    kind of error (not per temporary file named), no retry every tick; what it writes at the next
    change the Python device reads."""
    (tmp_path / "session.json").mkdir()         # the rename over it fails, after the temp file is written
    proc = subprocess.run(java_build.java_command("-cp", java_build.built(), "org.fedfleet.device.SessionTraces",
                                                  "--save-failing", str(tmp_path / "session.json")),
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout) == {"warnings": 1, "failed": True, "retried": False, "written": True, "same_kind": True}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["session.json"]      # no temp file left
    session = DeviceSession()
    assert SessionMemoryFile(tmp_path / "session.json").load_into(session, now=2000.0)
    assert list(session.last_started) == ["j0", "j1", "j2", "j3"]
