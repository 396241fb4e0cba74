"""Every ordinary mistake with the ``fedfleet`` command gets one line saying what is wrong, a
non-zero exit and no traceback; help and --version work. Each case runs the real console command."""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

FEDFLEET = str(Path(sys.executable).with_name("fedfleet"))


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("cli")
    (d / "bad.json").write_text("{not json")
    (d / "unknown.json").write_text(json.dumps({"devices": 3, "bogus_field": 1}))
    (d / "job.json").write_text(json.dumps({"num_classes": 10}))
    (d / "huge.json").write_text(json.dumps({"num_classes": 10 ** 9}))
    (d / "float-huge.json").write_text('{"lam": 1' + "0" * 400 + "}")
    (d / "sim-float-huge.json").write_text('{"alpha": 1' + "0" * 400 + "}")
    (d / "wide.json").write_text(json.dumps({"num_classes": 20_000, "feature_dim": 1280}))
    (d / "complete-sync.json").write_text(json.dumps({"graph": "complete", "clients_per_round": 642}))
    (d / "list.json").write_text("[1, 2]")
    (d / "state.db.keys").write_text("a file where the store's key folder goes")
    (d / "deep.json").write_text("[" * 100_000)
    (d / "creds.json").write_text(json.dumps({"device_id": "cam1", "mqtt_username": "cam1", "mqtt_password": "x"}))
    import io
    import zipfile

    import numpy as np

    header = io.BytesIO()
    np.lib.format.write_array_header_1_0(header, {"descr": "<f8", "fortran_order": False, "shape": (10 ** 11, 1000)})
    with zipfile.ZipFile(d / "lying.npz", "w") as archive:
        archive.writestr("Z.npy", header.getvalue() + bytes(64))
    os.mkfifo(d / "fifo")
    import struct

    for name, arr in (("im.idx", np.zeros((2, 8, 8), np.uint8)), ("lb.idx", np.array([0, 1], np.uint8))):
        (d / name).write_bytes(struct.pack(">HBB", 0, 8, arr.ndim) + struct.pack(f">{arr.ndim}I", *arr.shape)
                               + arr.tobytes())
    for cls in ("cat", "dog"):
        (d / "photos" / cls).mkdir(parents=True)
    return d


CASES = [
    ("missing --config", ["simulate", "--config", "{d}/nope.json"], "does not exist"),
    ("misspelt preset", ["simulate", "--config", "dmeo"], "neither a preset"),
    ("bad JSON", ["simulate", "--config", "{d}/bad.json"], "not valid JSON"),
    ("unknown config field", ["simulate", "--config", "{d}/unknown.json"], "unknown field 'bogus_field'"),
    ("bad broker scheme", ["simulate", "--config", "smoke", "--broker", "htp://x", "--out", "{d}/never"], "scheme"),
    ("unreachable broker", ["simulate", "--config", "smoke", "--broker", "mqtt://127.0.0.1:1", "--out", "{d}/never"],
     "cannot reach the MQTT broker"),
    ("serve: missing config", ["aggregator", "serve", "--out", "{d}/o", "--config", "{d}/nope.json"], "does not exist"),
    ("serve: bad JSON", ["aggregator", "serve", "--out", "{d}/o", "--config", "{d}/bad.json"], "not valid JSON"),
    ("serve: over a limit", ["aggregator", "serve", "--out", "{d}/o", "--config", "{d}/huge.json"], "num_classes"),
    # a review's finding: an integer no float holds, given to a float field, was an OverflowError traceback
    ("serve: a float of 401 digits", ["aggregator", "serve", "--out", "{d}/o", "--config", "{d}/float-huge.json"],
     "'lam'"),
    ("simulate: a float of 401 digits", ["simulate", "--config", "{d}/sim-float-huge.json", "--out", "{d}/never"],
     "'alpha'"),
    # a review's finding: a task larger than any device takes was served, and declined by them all
    ("serve: a task no device takes", ["aggregator", "serve", "--out", "{d}/o", "--kind", "scaffold", "--config",
                                       "{d}/wide.json", "--broker", "mqtt://127.0.0.1:1"], "a device takes in one message"),
    # a review's finding: a secure vector whose rounds ask a device more masks than it expands was
    # served, and refused when the job was built (tests/test_secure_vector_at_create.py: the API)
    ("serve: a secure round no device masks", ["aggregator", "serve", "--out", "{d}/o", "--kind", "fed3r-sync",
                                               "--config", "{d}/complete-sync.json", "--broker", "mqtt://127.0.0.1:1"],
     "644 masks of 833932 words"),
    # a review's finding: the store's default key folder (STATE.keys) was not checked at start
    ("serve: the store's key folder is a file", ["aggregator", "serve", "--out", "{d}/o", "--config", "{d}/job.json",
                                                 "--state", "{d}/state.db", "--broker", "mqtt://127.0.0.1:1"],
     "is not a folder"),
    # a review's finding: the store made every missing folder of --state, so a mistyped path
    # (/srv/fleett/state.db) made /srv/fleett and started an empty store in it
    ("serve: --state in a folder that does not exist", ["aggregator", "serve", "--out", "{d}/o", "--config",
                                                        "{d}/job.json", "--state", "{d}/never/state.db",
                                                        "--broker", "mqtt://127.0.0.1:1"],
     "/never does not exist: create it first"),
    ("serve: missing eval features", ["aggregator", "serve", "--out", "{d}/o", "--config", "{d}/job.json",
                                      "--eval-features", "{d}/nope.npz"], "--eval-features"),
    # a review's finding: an .npz header declaring 745 GiB was allocated (a MemoryError traceback)
    ("serve: eval features declaring a huge shape", ["aggregator", "serve", "--out", "{d}/o", "--config",
                                                     "{d}/job.json", "--eval-features", "{d}/lying.npz"], "declares"),
    ("serve: a service setting over its limit", ["aggregator", "serve", "--out", "{d}/o", "--config", "{d}/job.json",
                                                 "--ingest-workers", "-1"], "'ingest_workers'"),
    ("serve: bad broker", ["aggregator", "serve", "--out", "{d}/o", "--config", "{d}/job.json", "--broker",
                           "mqtt://h?version=4"], "version"),
    ("serve: --ray without --shards", ["aggregator", "serve", "--out", "{d}/o", "--config", "{d}/job.json",
                                       "--ray", "auto"], "--shards K"),
    ("serve: more shards than buckets", ["aggregator", "serve", "--out", "{d}/o", "--config", "{d}/job.json",
                                         "--state", "{d}/never", "--shards", "65"], "shards must be between 1 and 64"),
    ("serve: no Ray cluster there", ["aggregator", "serve", "--out", "{d}/o", "--config", "{d}/job.json",
                                     "--shards", "2", "--ray", "127.0.0.1:1"], "cannot reach the Ray cluster"),
    ("device: missing IDX", ["device", "--id", "cam1", "--idx", "{d}/a.idx", "{d}/b.idx"], "No such file"),
    ("device: missing credentials", ["device", "--credentials", "{d}/nope.json", "--idx", "{d}/a.idx", "{d}/b.idx"],
     "does not exist"),
    ("device: credentials of another device", ["device", "--id", "cam2", "--credentials", "{d}/creds.json",
                                               "--idx", "{d}/a.idx", "{d}/b.idx"], "differs"),
    ("device: --personalize without --deployments", ["device", "--id", "cam1", "--idx", "{d}/a.idx", "{d}/b.idx",
                                                     "--personalize"], "needs --deployments"),
    # a review's findings: a FIFO hung the command, an image size no device runs asked for 37 GiB,
    # and a class named "" or ".." labelled the images of the root or another folder
    ("features: an IDX FIFO", ["features", "--idx", "{d}/fifo", "{d}/fifo", "--backbone", "mobilenet_v2",
                               "-o", "{d}/x.npz"], "not a regular file"),
    ("features: an image size no device runs", ["features", "--idx", "{d}/im.idx", "{d}/lb.idx", "--backbone",
                                                "mobilenet_v2", "--image-size", "100000", "-o", "{d}/x.npz"],
     "--image-size 100000"),
    ("device: a class named by a path", ["device", "--id", "cam1", "--image-folder", "{d}/photos", "--classes",
                                         "cat,../photos/cat"], "no folder name"),
    ("device: an empty class name", ["device", "--id", "cam1", "--image-folder", "{d}/photos", "--classes",
                                     "cat,"], "no folder name"),
    ("device: no thread", ["device", "--id", "cam1", "--idx", "{d}/im.idx", "{d}/lb.idx", "--threads", "0"],
     "--threads must be >= 1"),
    ("device: a held-out fraction of 1", ["device", "--id", "cam1", "--idx", "{d}/nope", "{d}/nope",
                                          "--holdout-fraction", "1"], "--holdout-fraction must be in [0, 1)"),
    ("device: no room for bundles", ["device", "--id", "cam1", "--idx", "{d}/a.idx", "{d}/b.idx",
                                     "--bundle-disk-mb", "0"], "--bundle-disk-mb must be a size in MB"),
    ("device: a feature cache of NaN MB", ["device", "--id", "cam1", "--idx", "{d}/a.idx", "{d}/b.idx",
                                           "--feature-cache-mb", "nan"], "--feature-cache-mb must be a size in MB"),
    ("device: secure-only without a key", ["device", "--id", "cam1", "--idx", "{d}/a.idx", "{d}/b.idx",
                                           "--secure-only"], "--secure-only answers only secure rounds"),
    ("admin: API down", ["admin", "status", "--token", "t" * 20, "--url", "http://127.0.0.1:1"], "cannot reach"),
    ("admin: a job config that is not an object", ["admin", "job", "create", "{d}/list.json", "--kind", "fed3r",
                                                   "--token", "t" * 20, "--url", "http://127.0.0.1:1"], "JSON object"),
    # a review's findings: ids that would put another path or action into the request (pause
    # 'ops/cancel?x=' cancelled the job), or that no path reaches; a config too deep to parse
    ("admin: a job id naming another action", ["admin", "job", "pause", "ops/cancel?x=", "--token", "t" * 20,
                                               "--url", "http://127.0.0.1:1"], "is not an id"),
    ("admin: a device id with a path in it", ["admin", "device", "revoke", "d1/../d2/forget", "--token", "t" * 20,
                                              "--url", "http://127.0.0.1:1"], "is not an id"),
    ("admin: a deployment id of dots", ["admin", "deployment", "rollback", "..", "--token", "t" * 20,
                                        "--url", "http://127.0.0.1:1"], "is not an id"),
    ("admin: a job config nested too deeply", ["admin", "job", "create", "{d}/deep.json", "--token", "t" * 20,
                                               "--url", "http://127.0.0.1:1"], "nested too deeply"),
]


# a few through the installed console command (the real entry point), the rest through its main()
THROUGH_THE_COMMAND = {"bad JSON", "serve: over a limit", "device: missing IDX", "admin: API down"}


@pytest.mark.parametrize("name,argv,words", CASES, ids=[c[0] for c in CASES])
def test_a_mistake_is_one_line_without_a_traceback(files, name, argv, words, capsys):
    argv = [a.format(d=files) for a in argv]
    if name in THROUGH_THE_COMMAND:
        proc = subprocess.run([FEDFLEET, *argv], capture_output=True, text=True, timeout=120)
        code, stderr = proc.returncode, proc.stderr
    else:
        from fedfleet.cli import main

        code, stderr = main(argv), capsys.readouterr().err
    lines = [line for line in stderr.splitlines() if line.strip()]
    assert code != 0, stderr
    assert "Traceback" not in stderr, stderr
    assert len(lines) == 1 and words in lines[0], stderr
    assert not (files / "never").exists()                 # nothing written before the check


def test_help_and_version(capsys, monkeypatch):
    bare = subprocess.run([FEDFLEET], capture_output=True, text=True, timeout=60)
    assert "simulate" in bare.stdout and "usage" in bare.stdout and "Traceback" not in bare.stderr
    version = subprocess.run([FEDFLEET, "--version"], capture_output=True, text=True, timeout=60)
    assert version.returncode == 0 and version.stdout.startswith("fedfleet ")
    # the server's help through main() here: the console command's path is the two runs above, and a
    # process of its own would import torch again only to print text
    from fedfleet.cli import main

    monkeypatch.setenv("COLUMNS", "2000")                              # argparse wraps at hyphens otherwise
    with pytest.raises(SystemExit) as stop:
        main(["aggregator", "serve", "--help"])
    helps = capsys.readouterr().out
    assert stop.value.code == 0
    from aggregator.jobs.registry import KINDS
    for kind in KINDS:                                                  # every registered kind is explained
        assert kind + ":" in helps, kind
    assert "``" not in helps and "(default: mqtt://127.0.0.1:1883)" in " ".join(helps.split())
    # a help that says its default, or a default of nothing, gets none added ("(default: ())" was)
    assert not re.search(r"\(default[^)]*\) \(default|\(default: (\(\)|None|)\)", helps), helps


# Run by a fresh interpreter: which modules main() imported for each argv, and its exit code.
IMPORTS_OF = """
import contextlib, io, json, sys
from fedfleet.cli import main
argv = json.loads(sys.argv[1])
with contextlib.redirect_stdout(io.StringIO()) as out:
    try:
        code = main(argv)
    except SystemExit as exc:
        code = exc.code
print(json.dumps({"code": code, "torch": "torch" in sys.modules, "aggregator": "aggregator" in sys.modules,
                  "out": out.getvalue()}))
"""


EVERY_COMMAND = ("simulate", "aggregator", "device", "admin", "features", "export")


@pytest.mark.parametrize("argv, words", [
    ([], EVERY_COMMAND), (["--help"], EVERY_COMMAND), (["--version"], ("fedfleet 0.",)),
    (["admin", "--help"], ("usage: fedfleet admin", "--token", "forget")),
    (["device", "--help"], ("usage: fedfleet device", "--broker", "--credentials")),
    (["features", "--help"], ("usage: fedfleet features", "--bundle")),
    (["--debug", "admin", "status", "--help"], ("usage: fedfleet admin status", "--token"))])
def test_only_the_named_commands_parser_is_built_so_help_version_and_admin_never_import_the_server(argv, words):
    """An operator's ``fedfleet admin ...`` (and ``--version``, ``--help``, a device's ``device``)
    builds its own parser only: the server's (the job registry's choices) imports torch, seconds
    a call; their help still lists every command, or the command's own arguments."""
    proc = subprocess.run([sys.executable, "-c", IMPORTS_OF, json.dumps(argv)], capture_output=True, text=True,
                          timeout=60, cwd=Path(__file__).resolve().parents[1])
    seen = json.loads(proc.stdout.strip().splitlines()[-1])
    assert not seen["torch"] and not seen["aggregator"], (argv, proc.stderr[-2000:])
    assert seen["code"] in (0, 2), proc.stderr[-2000:]
    for word in words:
        assert word in seen["out"], (argv, word)


def test_a_named_command_still_gets_its_whole_parser():
    """What the lazy build must not lose: the server's arguments and choices where they are asked for."""
    from fedfleet.cli import build_parser

    simulate = build_parser(["simulate"]).parse_args(["simulate", "--config", "smoke", "--secure", "--shards", "2"])
    assert simulate.cmd == "simulate" and simulate.secure and simulate.shards == 2
    with pytest.raises(SystemExit):                 # a command not built takes no arguments of its own
        build_parser(["admin"]).parse_args(["simulate", "--shards", "2"])


def test_an_unknown_command_is_one_clear_error_without_importing_the_server():
    proc = subprocess.run([sys.executable, "-c", IMPORTS_OF, json.dumps(["bogus", "--shards", "2"])],
                          capture_output=True, text=True, timeout=60, cwd=Path(__file__).resolve().parents[1])
    seen = json.loads(proc.stdout.strip().splitlines()[-1])
    assert seen["code"] == 2 and not seen["torch"] and not seen["aggregator"]
    assert "invalid choice: 'bogus'" in proc.stderr and "Traceback" not in proc.stderr


def _admin_in_a_bounded_process(*argv: str) -> subprocess.CompletedProcess:
    """``fedfleet admin ...`` in a fresh interpreter of this tree, its address space capped at 2 GiB
    (a reader without a bound fails there with a MemoryError, not by taking the test machine's
    memory) and its time at 60 s (a FIFO opened for reading blocked for ever)."""
    import resource

    def cap_memory():
        resource.setrlimit(resource.RLIMIT_AS, (2 << 30, 2 << 30))

    return subprocess.run([sys.executable, "-m", "fedfleet.cli", "admin", "--url", "http://127.0.0.1:1", *argv],
                          capture_output=True, text=True, timeout=60, preexec_fn=cap_memory,
                          cwd=Path(__file__).resolve().parents[1])


@pytest.mark.parametrize("target", ["/dev/zero", "fifo", "directory"])
@pytest.mark.parametrize("role", ["job config", "--token-file"])
def test_an_admin_file_that_is_no_regular_file_is_refused_at_once(tmp_path, role, target):
    """A review's finding: ``fedfleet admin job create FILE`` checked st_size (0 for a device or a
    FIFO) and then read the whole file, so /dev/zero grew the client's memory without end and a
    FIFO blocked it for ever; --token-file read without any check. Now one line, exit 2, at once."""
    path = {"/dev/zero": "/dev/zero", "fifo": str(tmp_path / "fifo"), "directory": str(tmp_path)}[target]
    if target == "fifo":
        os.mkfifo(path)
    (tmp_path / "job.json").write_text(json.dumps({"job_id": "abc"}))
    argv = ["--token", "t" * 20, "job", "create", path] if role == "job config" else \
        ["--token-file", path, "job", "create", str(tmp_path / "job.json")]
    proc = _admin_in_a_bounded_process(*argv)
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert len(lines) == 1 and "is not a regular file" in lines[0] and path in lines[0], proc.stderr


def test_an_admin_file_larger_than_its_bound_is_refused_unread(tmp_path):
    config, token = tmp_path / "job.json", tmp_path / "token"
    with open(config, "wb") as f:
        f.truncate(2 << 20)                           # sparse: 2 MiB, more than the API takes
    token.write_text("t" * 20 + " " * (1 << 20))
    for argv, words in ((["--token", "t" * 20, "job", "create", str(config)], "more than 1048576"),
                        (["--token-file", str(token), "jobs"], "more than 65536")):
        proc = _admin_in_a_bounded_process(*argv)
        assert proc.returncode == 2 and words in proc.stderr and len(proc.stderr.splitlines()) == 1, proc.stderr


def test_an_admin_job_file_naming_a_key_twice_is_refused_before_any_request(tmp_path):
    """The API refuses a JSON body that names a key twice; the command parsed the file first and
    sent only the last value, so the API never saw it: one line, exit 2, no request made (no API
    runs here: a request would fail with a connection error instead)."""
    config = tmp_path / "job.json"
    config.write_text('{"job_id": "a", "kind": "fed3r", "config": {"lam": 0.5, "lam": 1000.0}}')
    proc = _admin_in_a_bounded_process("--token", "t" * 20, "job", "create", str(config))
    assert proc.returncode == 2 and len(proc.stderr.splitlines()) == 1, proc.stderr
    assert "duplicate key 'lam'" in proc.stderr and "connect" not in proc.stderr.lower()


@pytest.mark.parametrize("config", ["huge.json", "bad.json", "nope.json"])
def test_python_m_aggregator_reports_a_mistake_as_fedfleet_aggregator_does(files, config, capsys):
    """A review's finding: ``python -m aggregator serve`` (what process managers and the suite run)
    printed a 19-line traceback, exit 1, for a bad --config where ``fedfleet aggregator serve``
    printed one line, exit 2. Both now print the same line."""
    from fedfleet.cli import main

    argv = ["serve", "--out", str(files / "o"), "--config", str(files / config), "--broker", "mqtt://127.0.0.1:1"]
    proc = subprocess.run([sys.executable, "-m", "aggregator", *argv], capture_output=True, text=True, timeout=120,
                          cwd=Path(__file__).resolve().parents[1])
    # fedfleet's side through its main() here: `python -m fedfleet.cli` is sys.exit(main()), whose
    # exit codes the bounded-file tests below see from a process of their own
    outcomes = [(proc.returncode, proc.stderr), (main(["aggregator", *argv]), capsys.readouterr().err)]
    for code, stderr in outcomes:
        assert "Traceback" not in stderr and len(stderr.splitlines()) == 1, stderr[-2000:]
    assert outcomes[0] == outcomes[1] and outcomes[0][0] == 2, outcomes


@pytest.mark.parametrize("command", [["simulate", "--config"], ["aggregator", "serve", "--out", "o", "--config"]])
def test_a_config_is_checked_before_torch_is_imported(tmp_path, command):
    """The job registry every config check builds on imports torch only where the jobs compute:
    a mistake in a config is reported without torch's import first (0.30x the time: bench/cli_start.py),
    nor scipy's (the CPU's LAPACK calls import it where they factorise: aggregator/compute/device.py)."""
    bad = tmp_path / "bad.json"
    bad.write_text('{"devices": 4, "devices": 5}')
    code = "import sys\nfrom fedfleet.cli import main\nprint(main(sys.argv[1:]), 'torch' in sys.modules, 'scipy' in sys.modules)"
    proc = subprocess.run([sys.executable, "-c", code, *command, str(bad)], capture_output=True, text=True,
                          timeout=120, cwd=tmp_path, env=dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[1])))
    assert proc.stdout.split() == ["2", "False", "False"], (proc.stdout, proc.stderr[-2000:])
    assert "duplicate key 'devices'" in proc.stderr


@pytest.mark.parametrize("command", [["simulate"], ["aggregator", "serve", "--out", "o"]])
@pytest.mark.parametrize("case", ["deep", "duplicate", "fifo", "/dev/zero"])
def test_a_json_file_the_command_reads_is_bounded_and_refused_in_one_line(tmp_path, case, command, capsys,
                                                                        monkeypatch):
    """A review's findings: the JSON files the fedfleet command reads (simulate --config, device
    --credentials, --compare-with) were read whole and parsed as they came: JSON nested too deeply
    was a RecursionError traceback, a FIFO blocked for ever, /dev/zero filled memory, a key named
    twice kept its last value. Each is now one line, exit 2 (the FIFO and /dev/zero in a process
    capped at 2 GiB and 60 s).
    ``aggregator serve --config`` (a job config) was read the old way until stop 68."""
    import resource

    path = {"deep": tmp_path / "deep.json", "duplicate": tmp_path / "dup.json", "fifo": tmp_path / "fifo",
            "/dev/zero": Path("/dev/zero")}[case]
    if case == "deep":
        path.write_text("[" * 100_000 + "]" * 100_000)
    elif case == "duplicate":
        path.write_text('{"devices": 4, "devices": 400000}')
    elif case == "fifo":
        os.mkfifo(path)

    def cap_memory():
        resource.setrlimit(resource.RLIMIT_AS, (2 << 30, 2 << 30))

    if case in ("fifo", "/dev/zero"):       # a reader without a bound blocks or grows: its own capped process
        proc = subprocess.run([sys.executable, "-m", "fedfleet.cli", *command, "--config", str(path)],
                              capture_output=True, text=True, timeout=60, preexec_fn=cap_memory, cwd=tmp_path,
                              env=dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[1])))
        code, stderr = proc.returncode, proc.stderr
    else:                                   # a file that neither blocks nor grows: main() in this process
        from fedfleet.cli import main

        monkeypatch.chdir(tmp_path)
        code, stderr = main([*command, "--config", str(path)]), capsys.readouterr().err
    lines = [line for line in stderr.splitlines() if line.strip()]
    assert code == 2 and len(lines) == 1 and "Traceback" not in stderr, stderr[-2000:]
    assert {"deep": "nested too deeply", "duplicate": "duplicate key 'devices'", "fifo": "not a regular file",
            "/dev/zero": "not a regular file"}[case] in lines[0]


@pytest.mark.parametrize("option", ["--enrolled", "--identity"])
@pytest.mark.parametrize("target", ["fifo", "/dev/zero"])
def test_an_option_file_of_aggregator_serve_is_read_bounded(broker, tmp_path, option, target):
    """A review's finding: `aggregator serve --enrolled` and `--identity` read their file whole with
    no check: a FIFO blocked the start for ever, /dev/zero was a MemoryError traceback. One line,
    exit 2 (a process capped at 2 GiB and 60 s)."""
    import resource

    path = tmp_path / "fifo" if target == "fifo" else Path(target)
    if target == "fifo":
        os.mkfifo(path)
    (tmp_path / "job.json").write_text(json.dumps({"num_classes": 10}))

    def cap_memory():
        resource.setrlimit(resource.RLIMIT_AS, (2 << 30, 2 << 30))

    proc = subprocess.run([sys.executable, "-m", "aggregator", "serve", "--out", str(tmp_path / "o"), "--config",
                           str(tmp_path / "job.json"), "--broker", broker.url, option, str(path), "--timeout", "5"],
                          capture_output=True, text=True, timeout=60, preexec_fn=cap_memory,
                          cwd=Path(__file__).resolve().parents[1])
    lines = [line for line in proc.stderr.splitlines() if line.strip() and "WARNING" not in line]
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert len(lines) == 1 and f"{option} '{path}' is not a regular file" in lines[0], proc.stderr[-2000:]


@pytest.mark.parametrize("bad_id", ["x/#", "cam\x0b1", "cam 1", "aggregator", "c" * 65])
def test_aggregator_serve_refuses_an_enrolled_id_no_other_way_in_takes(broker, tmp_path, capsys, bad_id):
    """A review's finding: the ids of `aggregator serve --enrolled` went to the service and its store
    unchecked, where every other way a device id comes in (enrolment, the broker's accounts, a
    cohort) refuses one outside protocols.topics.DEVICE_ID_RE, or the aggregator's own. One line
    naming the file's line and the id, exit 2, no state file made."""
    from aggregator.cli import main as aggregator_main

    (tmp_path / "job.json").write_text(json.dumps({"num_classes": 10}))
    (tmp_path / "enrolled.txt").write_text(f"cam0\n\n{bad_id}\ncam2\n")
    rc = aggregator_main(["serve", "--out", str(tmp_path / "o"), "--config", str(tmp_path / "job.json"),
                          "--broker", broker.url, "--state", str(tmp_path / "agg.db"),
                          "--enrolled", str(tmp_path / "enrolled.txt"), "--timeout", "3"])
    lines = [line for line in capsys.readouterr().err.splitlines() if line.strip() and "WARNING" not in line]
    assert rc == 2 and len(lines) == 1, lines
    assert f"--enrolled '{tmp_path / 'enrolled.txt'}' line 3" in lines[0] and f"invalid device id {bad_id!r}" in lines[0], lines
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith("agg")) == []


@pytest.mark.parametrize("mistake", ["identity", "token"])
def test_aggregator_serve_creates_no_state_before_refusing_an_option(broker, tmp_path, capsys, mistake, monkeypatch):
    """A review's finding: a bad --identity PEM, or --api with no token, was refused in one line
    but only after the --state database (and its blob folder) had been created."""
    from aggregator.cli import main as aggregator_main

    monkeypatch.delenv("FEDFLEET_ADMIN_TOKEN", raising=False)
    (tmp_path / "job.json").write_text(json.dumps({"num_classes": 10}))
    (tmp_path / "bad.pem").write_text("-----BEGIN PRIVATE KEY-----\nnot a key\n-----END PRIVATE KEY-----\n")
    extra = ["--identity", str(tmp_path / "bad.pem")] if mistake == "identity" else ["--api", "127.0.0.1:0"]
    try:
        rc = aggregator_main(["serve", "--out", str(tmp_path / "o"), "--config", str(tmp_path / "job.json"),
                              "--broker", broker.url, "--state", str(tmp_path / "agg.db"), *extra])
        err = capsys.readouterr().err
    except SystemExit as stop:          # a refusal the command prints as its exit message
        rc, err = 1, str(stop)
    assert rc in (1, 2) and ("token" in err if mistake == "token" else "identity" in err.lower() or "pem" in err.lower()), err
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith("agg")) == [], err


@pytest.mark.parametrize("target", ["fifo", "junk"])
def test_a_broker_ca_file_is_checked_before_anything_connects(tmp_path, target):
    """A review's finding: --tls-ca was read only when the client connected: a FIFO blocked the
    device and the aggregator for ever, and a file that is no certificate was an ssl.SSLError
    traceback. The address refuses it at once, one ValueError naming the option."""
    from protocols.mqtt_link import BrokerConfig

    path = tmp_path / target
    if target == "fifo":
        os.mkfifo(path)
    else:
        path.write_text("not a certificate")
    with pytest.raises(ValueError, match=r"--tls-ca.*(not a regular file|holds no PEM certificate)"):
        BrokerConfig.from_url("mqtts://127.0.0.1:8883", tls_ca=str(path))
