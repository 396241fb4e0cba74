"""Run the aggregator service with its operations side: durable store, admin API, broker security.

``aggregator.cli serve`` calls :func:`add_ops_arguments` on its parser and :func:`serve_with_ops`
to run; the API runs in the same process (uvicorn on a thread) and talks to the service through
``AggregatorService.call`` and its ``live`` snapshot.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import os
import signal
import socket
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, Iterator

from protocols.command_errors import UserError
from protocols.mqtt_link import BrokerConfig
from protocols.regular_file import OPTION_FILE_BYTES, read_regular_file
from protocols.topics import AGGREGATOR_ID

from aggregator.api.origins import DashboardOrigins
from aggregator.service.settings import ServiceSettings

if TYPE_CHECKING:
    from aggregator.service.artifacts import ArtifactShelf

TOKEN_ENV = "FEDFLEET_ADMIN_TOKEN"


class ApiServer:
    """uvicorn on a daemon thread; ``port=0`` picks a free port (see ``.port`` after ``start``)."""

    def __init__(self, app, host: str = "127.0.0.1", port: int = 0, head_timeout_s: float | None = None):
        import uvicorn

        from aggregator.api.connections import REQUEST_HEAD_TIMEOUT_S, bounded_protocol, raise_open_files_limit

        raise_open_files_limit()
        # no limit_concurrency: it counts connections with or without the token, so a flood without
        # it starved the operator; the app's guard holds the request slots (connections.py)
        self.server = uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level="warning",
                                                    access_log=False, lifespan="off",
                                                    http=bounded_protocol(head_timeout_s or REQUEST_HEAD_TIMEOUT_S)))
        self.host = host
        self.port = port
        self._thread: threading.Thread | None = None

    def start(self, timeout: float = 15.0) -> "ApiServer":
        self._thread = threading.Thread(target=self.server.run, name="admin-api", daemon=True)
        self._thread.start()
        deadline = time.monotonic() + timeout
        while not self.server.started:
            if time.monotonic() > deadline or not self._thread.is_alive():
                raise RuntimeError(f"admin API did not start on {self.host}:{self.port}")
            time.sleep(0.02)
        self.port = self.server.servers[0].sockets[0].getsockname()[1]
        return self

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def stop(self) -> None:
        self.server.should_exit = True
        if self._thread:
            self._thread.join(timeout=10)


def add_ops_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("operations")
    g.add_argument("--state", type=Path, default=None,
                   help="SQLite state file, in a folder that exists (contribution payloads in FILE.blobs/ beside "
                        "it; back up both): durable jobs, rounds and contributions; restarting resumes the job")
    g.add_argument("--durability", choices=["full", "normal"], default="full",
                   help="full: every commit is on disk before the ack (default); normal: faster, may lose the "
                        "last commits on power loss (never on a process crash)")
    g.add_argument("--api", default=None, metavar="HOST:PORT", help="serve the admin API and dashboard here")
    g.add_argument("--public-origin", action="append", default=[], metavar="SCHEME://HOST[:PORT]",
                   help="an address browsers reach the dashboard at through a reverse proxy that rewrites Host, "
                        "e.g. https://fleet.example.com (repeat for several): a change made from it with the "
                        "dashboard's session is not refused as cross-origin (X-Forwarded-Host is never trusted)")
    g.add_argument("--api-token-file", type=Path, default=None,
                   help=f"file holding the admin token (or set {TOKEN_ENV})")
    g.add_argument("--security-dir", type=Path, default=None,
                   help="broker security files (python -m aggregator.security.broker DIR): the aggregator logs in "
                        "with its account there and rewrites passwd/ACL + reloads mosquitto on enrol/revoke")
    g.add_argument("--require-signatures", action="store_true",
                   help="accept only messages signed with the sender's enrolled Ed25519 key (with --shards: each shard "
                        "verifies what it reads against the keys the aggregator sends it)")
    g.add_argument("--identity", type=Path, default=None,
                   help="the aggregator's Ed25519 private key (PEM): every message it sends is signed with it, "
                        "and enrolment hands devices its public key to verify them (default: unsigned, development)")
    g.add_argument("--key-dir", type=Path, default=None,
                   help="folder of the key the store's secrets are sealed under (a sampled DP job's draw key), kept "
                        "out of the store and its backups (default: --security-dir, else STATE.keys/)")
    g.add_argument("--keep-serving", action="store_true",
                   help="after the job, keep running and start jobs queued through the API")


def admin_token(args) -> str | None:
    if args.api_token_file:
        return read_regular_file(args.api_token_file, "--api-token-file", OPTION_FILE_BYTES).decode("utf-8").strip()
    return os.environ.get(TOKEN_ENV)


def shard_pool(args, count: int, job, broker: BrokerConfig, out_dir: Path, settings: ServiceSettings):
    """``--shards K``: K shard processes here, or with ``--ray ADDRESS`` K actors on that Ray cluster,
    their stores beside the service's (``STATE.shards/``); a job they cannot serve is refused
    before any starts."""
    from aggregator.jobs.registry import job_kind_name
    from aggregator.shards.pool import check_shardable

    if job is not None:
        check_shardable(job, job_kind_name(job))
    store_dir = Path(f"{args.state}.shards") if args.state else Path(out_dir) / "shards"
    if getattr(args, "ray", None):
        from aggregator.shards.ray_shards import RayShards

        return RayShards(args.ray, count, broker, store_dir.resolve(), settings.topics, settings.max_message_bytes)
    from aggregator.shards.local import LocalShards

    # every shard holds a device's message to the bound the service itself applies
    return LocalShards(count, broker, store_dir, settings.topics, settings.max_message_bytes)


def api_address(text: str) -> tuple[str, int]:
    """(host, port) of ``--api HOST:PORT`` (host default 127.0.0.1), checked by listening there once:
    ValueError with the reason (a port out of range, an address not on this host, a port in use)."""
    host, _, port = text.rpartition(":")
    host = host.strip("[]") or "127.0.0.1"
    if not port.isdigit() or not 0 <= int(port) < 65536:         # 0: any free port (the URL is printed)
        raise ValueError(f"--api {text!r}: expected HOST:PORT with a port in 0..65535")
    try:
        socket.create_server((host, int(port))).close()
    except OSError as exc:
        raise ValueError(f"--api {text!r}: cannot listen there: {exc.strerror or exc}") from None
    return host, int(port)


def dashboard_origins(args) -> DashboardOrigins:
    """The dashboard's origins from ``--public-origin`` (ValueError, one line: a value that is not
    scheme://host[:port], or the flag without ``--api``)."""
    if args.public_origin and not args.api:
        raise ValueError("--public-origin names where browsers reach the dashboard: it needs --api")
    return DashboardOrigins(args.public_origin)


def checked_sealing_key(args) -> None:
    """Read the key the store's secrets are sealed under (``--key-dir``, else ``--security-dir``, else
    beside ``--state``) if it exists: a bad one, or a folder that is a file, is one ValueError at
    start, before the broker and the store (it stopped a sampled DP job at its first round)."""
    from aggregator.security.sealing_key import SealingKey

    if args.state:
        SealingKey.of_store(args.state, args.key_dir or args.security_dir).check()


def checked_state_folder(args) -> None:
    """``--state``'s folder must be there: ``serve`` makes the state file, never the folder it names.
    The store makes every missing folder (a shard's store on a Ray node needs its folder made
    there), so a mistyped path (/srv/fleett/state.db) made /srv/fleett and an empty store in it, and
    the next restart with the right path found no job. One ValueError at start, before the broker."""
    if args.state is not None and not (folder := args.state.parent).is_dir():
        raise ValueError(f"--state {args.state}: the folder {folder} "
                         f"{'is not a folder' if folder.exists() else 'does not exist: create it first'} "
                         f"(the aggregator makes its state file there, never the folder)")


@contextlib.contextmanager
def state_refusals(state: Path | None) -> Iterator[None]:
    """What the store refuses as ``serve`` opens it (a file that is no fedfleet database, a newer
    schema) or as --config's job is taken back from it (stored under another config, a row that
    does not restore) is one line naming --state, exit 2, the store as it was (it was a StoreError
    traceback at every restart: ``_start_next_job`` stops a stored job it cannot restore, but a
    --config job is the command's own)."""
    from aggregator.storage.store import StoreError

    try:
        yield
    except StoreError as exc:
        raise UserError(f"--state {state}: {exc}") from None


def read_identity(path: Path):
    """The aggregator's signing identity from an ``--identity`` PEM file (bounded, a regular file)."""
    from protocols.identity import DeviceIdentity

    return DeviceIdentity.from_pem(AGGREGATOR_ID, read_regular_file(path, "--identity", OPTION_FILE_BYTES))


def serve_with_ops(args, job, broker: BrokerConfig, out_dir: Path, settings: ServiceSettings, *,
                   enrolled: set[str] | None = None, eval_set=None, artifacts: ArtifactShelf | None = None,
                   shards: int = 0, identity=None) -> dict:
    """Build store/security/shards/API from ``args`` around an AggregatorService with ``settings`` and run it;
    ``identity``: the aggregator's signing key, read from ``--identity`` by the caller (:func:`read_identity`)."""
    from aggregator.security.broker import BrokerSecurity
    from aggregator.service.loop import AggregatorService
    from aggregator.storage.store import Store

    topics = settings.topics
    api_at = api_address(args.api) if args.api else None      # a bad one: one error before anything is built
    origins = dashboard_origins(args)
    # what the operator named is read and checked before the store is created: a bad --identity or
    # a missing token left a new state database behind (a review's finding)
    if (args.api or settings.keep_serving) and not args.state:
        raise SystemExit("--api and --keep-serving need --state")
    token = admin_token(args) if args.api else None
    if args.api and not token:
        raise SystemExit(f"--api needs a token: --api-token-file or {TOKEN_ENV}")
    key_dir = args.key_dir or args.security_dir         # the secrets' folder (checked by serve at start), not the store's
    with state_refusals(args.state):
        store = Store(args.state, synchronous=args.durability.upper(), key_dir=key_dir) if args.state else None
    security = None
    if args.security_dir:
        security = BrokerSecurity(args.security_dir, topics)
        if security.passwd_file.exists() and not security.accounts_are_current():     # an older version's: no shard accounts
            try:
                security.apply(store.password_hashes() if store is not None else security.device_hashes())
            except RuntimeError as exc:
                raise SystemExit(f"--security-dir {args.security_dir}: its passwd and acl lacked accounts this "
                                 f"version uses and were rewritten, but {exc}; restart the broker") from None
        if not broker.username:
            broker = dataclasses.replace(broker, username=AGGREGATOR_ID, password=security.aggregator_password,
                                         tls_ca=broker.tls_ca or str(security.ca_cert))
    pool = shard_pool(args, shards, job, broker, out_dir, settings) if shards else None
    with state_refusals(args.state):         # --config's job, taken back from the store as it is built
        service = AggregatorService(job, broker, out_dir, settings, enrolled=enrolled, eval_set=eval_set, store=store,
                                    security=security, artifacts=artifacts, identity=identity, shards=pool)
    deployments = None
    if store is not None:                    # model rollouts, beside the service (aggregator/deployments/)
        from aggregator.deployments.controller import DeploymentController

        verifier = service.fleet.verify if settings.require_signatures else None
        deployments = DeploymentController(store, broker, topics, signer=identity.sign if identity else None,
                                           verifier=verifier).start()
    api = None
    if args.api:
        from aggregator.api.app import create_app

        api = ApiServer(create_app(store, token, service, deployments, origins.public), *api_at).start()
        print(f"admin API on {api.url} (dashboard: {api.url}/dashboard/)", flush=True)
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, lambda *_: service.stop())     # clean stop; the job stays resumable
    try:
        return service.run(timeout_s=args.timeout)
    finally:
        if api:
            api.stop()
        if deployments:
            deployments.stop()
