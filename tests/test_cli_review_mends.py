"""What a review of the command line and the emulated fleet found, each mended (a user's secret
printed or written readable, device text driving the operator's terminal, options taken and
ignored, a traceback for a bad value, a broker left running):

* an error about ``--broker`` printed the enrolled device's MQTT password; reports kept it;
* credentials and private keys written with the umask's mode (an existing file kept 0644);
* device-controlled strings reached the terminal raw through ``fedfleet admin``;
* ``--dp-epsilon`` was taken by every pipeline and applied by none but fed3r/fedncm;
* ``--clients-per-round 0`` failed with a ZeroDivisionError after the features were extracted;
* a host fork server that died left mosquitto running after the fleet's exit.
"""

import json
import os
import signal
import stat
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from fedfleet import admin_client, admin_deployments, admin_rendering
from fedfleet.emulation.broker import BrokerTree
from fedfleet.emulation.fork_server import ForkServer
from fedfleet.emulation.local_hosts import LocalHosts
from fedfleet.sim_config import SimConfig
from fedfleet.simulate import EmulatedFleet
from protocols.identity import DeviceIdentity
from protocols.topics import Topics

SECRET = "S3CRETPASS-from-enrolment"


@pytest.mark.parametrize("broker", ["mqtt://127.0.0.1:1883?version=4", "mqtt://127.0.0.1:70000"])
def test_a_bad_broker_address_does_not_print_the_enrolled_password(tmp_path, capsys, broker):
    creds = tmp_path / "cam1.json"
    creds.write_text(json.dumps({"device_id": "cam1", "mqtt_username": "cam1", "mqtt_password": SECRET}))
    from fedfleet.cli import main

    rc = main(["device", "--credentials", str(creds), "--broker", broker,
               "--idx", str(tmp_path / "a.idx"), str(tmp_path / "b.idx")])
    err = capsys.readouterr().err
    # the address is checked before the enrolled account is added to it (nothing to redact)
    assert rc == 2 and SECRET not in err and broker in err and len(err.splitlines()) == 1, err
    from protocols.command_errors import describe
    assert SECRET not in describe(ValueError(f"broker URL 'mqtt://cam1:{SECRET}@127.0.0.1:70000': bad port"))


def test_a_report_keeps_the_broker_address_without_its_password():
    from fedfleet.pipeline import pipeline_report

    report = pipeline_report(SimConfig(broker="mqtt://alice:S3CRET-BROKER-PW@broker.example:1883"), None, {}, [])
    assert "S3CRET-BROKER-PW" not in json.dumps(report)
    assert report["config"]["broker"] == "mqtt://alice:***@broker.example:1883"


def test_secrets_are_written_owner_only_even_over_an_existing_file(tmp_path):
    from fedfleet.device_credentials import apply_credentials
    from fedfleet.emulation.identities import make_identities
    from protocols.files import write_private_file

    os.umask(0o022)
    existing = tmp_path / "cam1.json.out"
    existing.write_text("old")
    os.chmod(existing, 0o644)
    write_private_file(existing, b'{"mqtt_password": "x"}')
    assert stat.S_IMODE(existing.stat().st_mode) == 0o600 and existing.read_bytes() == b'{"mqtt_password": "x"}'
    creds = tmp_path / "cam1.json"
    creds.write_text(json.dumps({"device_id": "cam1", "mqtt_username": "cam1", "mqtt_password": "pw",
                                 "private_key_pem": DeviceIdentity.generate("cam1").to_pem().decode()}))
    key = tmp_path / "cam1.key.pem"
    key.write_text("stale")
    os.chmod(key, 0o644)                               # a key file left by an earlier enrolment
    args = SimpleNamespace(credentials=creds, id=None, broker="mqtt://127.0.0.1:1883", identity=None, tls_ca=None,
                           aggregator_key=None)
    apply_credentials(args)
    assert args.identity == key and stat.S_IMODE(key.stat().st_mode) == 0o600 and "PRIVATE KEY" in key.read_text()
    make_identities(tmp_path, ["cam1"])
    assert stat.S_IMODE((tmp_path / "aggregator.pem").stat().st_mode) == 0o600


def test_credentials_write_nothing_outside_their_folder_nor_through_a_symlink_nor_before_checks(tmp_path):
    """A review's finding: the enrolment file's device_id named the key files verbatim ("../escaped"
    wrote a private key one folder up), a symlink planted at <id>.key.pem had its target overwritten
    with the key, and both happened before a bad --broker was refused. Now every field is checked
    first and the files are replaced by a rename (the link itself, never its target)."""
    from fedfleet.device_credentials import apply_credentials
    from fedfleet.errors import UserError

    folder = tmp_path / "creds"
    folder.mkdir()
    pem = DeviceIdentity.generate("cam2").to_pem().decode()

    def apply(device_id, broker="mqtt://127.0.0.1:1883"):
        creds = folder / "cam.json"
        creds.write_text(json.dumps({"device_id": device_id, "mqtt_username": "u", "mqtt_password": "p",
                                     "private_key_pem": pem, "ca_pem": "-----BEGIN CERTIFICATE-----\n"}))
        args = SimpleNamespace(credentials=creds, id=None, broker=broker, identity=None, tls_ca=None,
                               aggregator_key=None)
        apply_credentials(args)
        return args

    with pytest.raises(UserError, match="invalid device id"):
        apply("../escaped")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["creds"] and [p.name for p in folder.iterdir()] == ["cam.json"]
    with pytest.raises(ValueError, match="scheme"):
        apply("cam2", broker="ftp://nowhere")
    assert [p.name for p in folder.iterdir()] == ["cam.json"]           # refused before anything was written
    victim = tmp_path / "victim.txt"
    victim.write_text("important data")
    os.symlink(victim, folder / "cam2.key.pem")
    args = apply("cam2")
    assert victim.read_text() == "important data"
    assert not (folder / "cam2.key.pem").is_symlink() and "PRIVATE KEY" in args.identity.read_text()
    assert stat.S_IMODE(args.identity.stat().st_mode) == 0o600


def test_dp_epsilon_is_refused_where_no_phase_would_apply_it(tmp_path, capsys):
    from fedfleet.cli import main

    for pipeline in ("fed3r-ft-oll", "ladd"):
        rc = main(["simulate", "--pipeline", pipeline, "--dp-epsilon", "1", "--out", str(tmp_path / pipeline)])
        err = capsys.readouterr().err
        assert rc == 2 and "--dp-epsilon" in err and "Traceback" not in err, err


def test_ladd_refuses_the_options_it_would_not_read(tmp_path, capsys):
    """A review's finding: --pipeline ladd ran LaddSimConfig and silently ignored --config (even a
    missing file), --devices and --seed, so a run started with other settings than the ones asked for."""
    from fedfleet.cli import main

    rc = main(["simulate", "--pipeline", "ladd", "--quick", "--config", "/nonexistent/my.json", "--devices", "3",
               "--seed", "7", "--ft-rounds", "2", "--out", str(tmp_path / "run")])
    err = capsys.readouterr().err
    assert rc == 2 and "Traceback" not in err, err
    named = err.split("does not read ")[1].split(":")[0].split(", ")
    assert sorted(named) == ["--config", "--devices", "--ft-rounds", "--seed"], err
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("field", ["clients_per_round", "devices", "workers"])
def test_a_count_below_one_is_one_clear_error_before_anything_runs(field):
    from fedfleet.errors import UserError
    from fedfleet.sim_config import load_config

    with pytest.raises(UserError, match=field):
        load_config("smoke", {field: 0})


EVIL = "\x1b]0;owned\x07\x1b[2J\x1b[1;1Hall devices OK"


def _clean(text: str) -> None:
    assert "\x1b" not in text and "\x07" not in text, repr(text)


def test_logs_escape_a_devices_decline_reason():
    line = admin_rendering.log_line({"t": time.time(), "job_id": "j", "event": "declined", "round": 1,
                           "device": "cam1", "reason": EVIL})
    _clean(line)


def test_devices_table_escapes_a_presence_profile():
    rows = admin_rendering.devices_rows([{"device_id": "cam1", "status": "not enrolled", "last_seen": None,
                                 "online": True, "cluster": None, "profile": {"model": EVIL}}])
    text = admin_rendering.table(rows, [("DEVICE", "device_id"), ("PROFILE", "profile_")])
    _clean(text)


def test_deployment_text_escapes_a_devices_refusal():
    d = {"deployment_id": "m1-1", "model_id": 1, "model_sha256": "ab" * 32, "state": "canary", "replaces": None,
         "cohort": "5%", "stages": [1.0], "stage": 0, "guard": "wma_drop<=1", "bake_s": 1.0, "min_reports": 1,
         "patience_s": 1.0, "reason": "", "history": [],
         "devices": {"cam1": {"sent": "run", "report": {"refused": EVIL}}}}
    _clean(admin_deployments.deployment_text(d))


def test_broker_is_stopped_even_if_the_hosts_fail_to_stop(tmp_path):
    (tmp_path / "sleeper.py").write_text("import time\ndef main(argv):\n    time.sleep(60)\n")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tmp_path), str(Path(__file__).resolve().parents[1])]))
    server = ForkServer(["sleeper"], env)
    hosts = LocalHosts(tmp_path, server)
    hosts.procs.append(server.start("sleeper", [], tmp_path / "w0.log"))
    broker = BrokerTree.for_devices(1, Topics()).start()
    fleet = EmulatedFleet(SimConfig(devices=1), tmp_path, [], None, quiet=True)
    fleet.broker, fleet.hosts, fleet.host_processes = broker, hosts, server
    os.kill(server.proc.pid, signal.SIGKILL)          # the host server dies
    server.proc.wait()
    try:
        try:
            fleet.__exit__(None, None, None)          # raised RuntimeError from stop_all, leaving the broker
        except Exception as exc:
            print("__exit__ raised", type(exc).__name__, exc)
    finally:
        leaked = broker.core.proc.poll() is None
        broker.stop()
        for p in hosts.procs:
            try:
                os.kill(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    assert not leaked, "mosquitto left running after EmulatedFleet.__exit__"


@pytest.mark.parametrize("api", ["127.0.0.1:99999", "192.0.2.77:8080", "localhost", "127.0.0.1:{taken}"])
def test_an_api_address_that_cannot_be_served_is_refused_with_the_reason(api):
    from aggregator.api.server import api_address

    import socket

    with socket.create_server(("127.0.0.1", 0)) as taken:
        with pytest.raises(ValueError, match="--api"):
            api_address(api.format(taken=taken.getsockname()[1]))


def test_an_api_address_that_cannot_be_served_is_one_clear_error_before_anything_is_built(tmp_path, broker):
    """It raised RuntimeError from the API server's start (a traceback), after the store, the service
    and the rollout controller were built; a port in use the same. (Each kind of bad address is
    refused by ``api_address`` above; one of them goes through the command.)"""
    import subprocess
    import sys

    env = dict(os.environ, FEDFLEET_ADMIN_TOKEN="abcdefghijklmnopqrstuvwxyz")
    proc = subprocess.run([str(Path(sys.executable).with_name("fedfleet")), "aggregator", "serve", "--state",
                           str(tmp_path / "s.db"), "--out", str(tmp_path / "out"), "--broker", broker.url,
                           "--api", "192.0.2.77:8080"], capture_output=True, text=True, timeout=120, env=env)
    assert proc.returncode == 2 and "--api" in proc.stderr and "Traceback" not in proc.stderr, proc.stderr[-1500:]
    assert not (tmp_path / "s.db").exists()                 # refused before the store was made


def test_shards_log_in_with_accounts_of_their_own_on_the_managed_broker(tmp_path):
    """Each shard logged in as the service's own account; the generated broker takes the user name as
    client id, so a shard and the service took each other's session over, for ever (a review's
    finding). Each shard has its role account now, reading every outbox as the service does."""
    import paho.mqtt.client as mqtt

    from aggregator.security.broker import BrokerSecurity, hash_password
    from aggregator.shards.buckets import shard_role
    from fedfleet.emulation.broker import MosquittoBroker, free_port
    from ops_fleet import wait_for
    from protocols.mqtt_link import BrokerConfig, MqttLink
    from protocols.topics import AGGREGATOR_ID

    sec = BrokerSecurity(tmp_path / "security")
    sec.initialise()
    sec.write_access_files({"cam1": hash_password("cam1-pw")})
    port = free_port()
    broker = MosquittoBroker(port=port, listener_config=sec.listener_config(port), workdir=tmp_path).start()
    cfg = BrokerConfig("127.0.0.1", port, AGGREGATOR_ID, sec.aggregator_password, tls_ca=str(sec.ca_cert))
    drops, got = [], []
    service = MqttLink(AGGREGATOR_ID, cfg, on_message=lambda t, p: None)
    service.start()
    service.client.on_disconnect = lambda *a, **k: drops.append(a)
    shards = [MqttLink(f"{AGGREGATOR_ID}-shard{i}of2", cfg.for_role(shard_role(i)),
                       on_message=lambda t, p: got.append(t), subscriptions=[(Topics().all_outboxes, 1)])
              for i in range(2)]
    device = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id="cam1")
    try:
        for shard in shards:
            shard.start()
        device.username_pw_set("cam1", "cam1-pw")
        device.tls_set(ca_certs=str(sec.ca_cert))
        device.connect("127.0.0.1", port)
        device.loop_start()
        wait_for(lambda: device.is_connected(), what="the device connected")
        device.publish(Topics().outbox("cam1"), b"x", qos=1).wait_for_publish(5)
        wait_for(lambda: len(got) == 2, what="both shards read the device's outbox")
        time.sleep(1.0)
        assert not drops and service.connected.is_set() and all(s.connected.is_set() for s in shards)
    finally:
        device.loop_stop()
        for link in shards + [service]:
            link.stop()
        broker.stop()


def test_the_admin_client_does_not_follow_a_redirect_with_its_token():
    """urllib's default handler re-sends every header, the bearer token included, to the host a
    redirect names; the admin API never redirects, so the client refuses and sends nothing on."""
    import http.server
    import threading

    seen: list[str | None] = []

    class Elsewhere(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            seen.append(self.headers.get("Authorization"))
            self.send_response(200)
            self.end_headers()
            self.wfile.write(b"{}")

        def log_message(self, *args):
            pass

    elsewhere = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Elsewhere)

    class Redirecting(Elsewhere):
        def do_GET(self):
            self.send_response(302)
            self.send_header("Location", f"http://127.0.0.1:{elsewhere.server_port}/steal")
            self.end_headers()

    api = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Redirecting)
    for server in (elsewhere, api):
        threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        client = admin_client.AdminClient(f"http://127.0.0.1:{api.server_port}", "s3cret-token", timeout=5)
        with pytest.raises(admin_client.AdminError, match="redirect"):
            client.get("/api/status")
        # the same request straight to the other server does carry the token: the check can fail
        admin_client.AdminClient(f"http://127.0.0.1:{elsewhere.server_port}", "s3cret-token", timeout=5).get("/x")
        assert seen == ["Bearer s3cret-token"]
    finally:
        for server in (elsewhere, api):
            server.shutdown()
            server.server_close()
