"""The device side of a model rollout (``protocols/payloads/deployment.py``).

:class:`ModelSlot` holds the head the application predicts with (``slot.predict(features)``) and
the one it replaced; a swap writes the new head's file, then replaces the small state file in one
``os.replace``, and only then changes the head in memory: a crash leaves the old or the new
version, never half of one, and a restart finds it again (each file checked against its sha256).

:class:`DeploymentFollower` listens on the device's retained deploy topic (its own MQTT client
beside the agent's), so an offline device receives the current assignment when it reconnects.
For a ``run`` it fetches the head in chunks unless it holds it, checks the sha256 and the head's
shape, counts on its held-out split how many samples the candidate and its current head get
right, swaps, and reports the counts; for a ``rollback`` it goes back to the version it kept.
An assignment that is not signed by the aggregator (when the device holds its key), names
another device, or carries a sequence below the one the slot holds (a captured assignment
replayed later) is refused; a head is taken only as the answer to the assignment being fetched
(its sha256 and its deployment; a newer assignment ends the fetch); a head that cannot be fetched,
verified or loaded is refused.
What fails on the device's own side (the application's held-out features, writing the slot) is
not the head's fault: the fetched head is adopted again every ``retry_s`` and refused only after
``fetch_timeout_s``, so a passing failure does not count against the rollout's guard.
In every case the device stays on its version, logs why and reports the reason's class
(``protocols.payloads.deployment.REFUSAL_REASONS``), at most one report per class every
``refusal_interval_s`` for what does not answer its own assignment (a flood of forged messages
becomes a trickle of reports).

A device that personalises (OLL, ``edge_client/oll.py``) gives the slot its local training labels:
it then predicts with the deployed head pruned to those classes, and judges every candidate and
its current head the same way, so the accuracy the fleet's guard sees is the one its application
gets. The labels live in the slot's state file, so the application's own ``ModelSlot(dir)`` predicts
the same way as the device process that follows the rollouts.
"""

from __future__ import annotations

import collections
import dataclasses
import errno
import fcntl
import hashlib
import json
import logging
import os
import re
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np

from edge_client.inbox import aggregator_inbox
from edge_client.oll import prune
from protocols.envelope import EnvelopeError, parse_strict_json
from protocols.files import write_atomic
from protocols.identity import sender_verifier
from protocols.message_loop import ENDS_THE_LOOP, QueueBound
from protocols.mqtt_link import BrokerConfig, LinkWorker, MqttLink
from protocols.payloads import deployment as D
from protocols.payloads.artifacts import ARTIFACT, ArtifactDigestMismatch, get_message, parse_artifact
from protocols.regular_file import read_regular_file
from protocols.topics import AGGREGATOR_ID, DEPLOY_ROLE, Topics

log = logging.getLogger("fedfleet.device")
STATE_FILE = "slot.json"
MAX_STATE_BYTES = 1 << 20    # slot.json: two versions' names, a sequence, a device's class ids
KEPT_REFUSALS = 256          # the latest refusals (and reports) a follower keeps in memory
MAX_WHY_CHARS = 500          # of a refusal's reason, as logged, kept and reported (the wire's bound too)
_HEAD_FILE = re.compile(r"[0-9a-f]{64}\.npz")      # a version's head, named by its sha256
_SHA256 = re.compile(r"[0-9a-f]{64}")
_LEGACY = object()          # a slot.json from before sequences named the key they were accepted under


@dataclass(frozen=True)
class HeadVersion:
    sha256: str
    deployment: str
    W: np.ndarray
    b: np.ndarray
    bundle_sha256: str = ""             # the exported bundle whose features it reads ("": the device's own)

    def logits(self, features: np.ndarray) -> np.ndarray:
        return np.asarray(features, dtype=np.float64) @ self.W.T + self.b

    def predict(self, features: np.ndarray, local_labels: np.ndarray | None = None) -> np.ndarray:
        """Global class ids; with ``local_labels`` the head is OLL-pruned to them first (the answer
        is always one of them; ValueError when the head has no row for one of them)."""
        if local_labels is None:
            return self.logits(features).argmax(1)
        W, b, label_map = prune(self.W, self.b, local_labels)
        return label_map.to_global((np.asarray(features, dtype=np.float64) @ W.T + b).argmax(1))


class ModelSlot:
    """The deployed head (current) and the one it replaced (previous), kept in ``state_dir``.
    ``local_labels``: the device personalises (OLL) with these training labels (kept in the state
    file; None: the ones saved there, if any)."""

    def __init__(self, state_dir: Path, local_labels=None):
        self.dir = Path(state_dir)
        self.dir.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()
        self.current: HeadVersion | None = None
        self.previous: HeadVersion | None = None
        self.local_labels: np.ndarray | None = None
        self.seq = 0                    # the highest assignment sequence accepted: a lower one is a replay
        self.seq_key: str | None | object = None   # the aggregator key it was held under (sha256; None: none)
        with _FolderLock(self.dir):     # not between another slot's head file going and its state
            self._load()
        if local_labels is not None:
            labels = np.unique(np.asarray(local_labels))
            if labels.ndim != 1 or labels.size == 0 or not np.issubdtype(labels.dtype, np.integer) or labels.min() < 0:
                raise ValueError(f"local labels must be non-negative integers, got {labels.dtype} {labels.shape}")
            self.local_labels = labels.astype(np.int64)
            with self._lock:
                self._commit(self.current, self.previous, labels_only=True)

    def _load(self) -> None:
        """What ``slot.json`` says (nothing when there is none)."""
        saved = self._saved()
        if saved is not None:
            self.current, self.previous = (self._read(saved.get(k)) for k in ("current", "previous"))
            self.seq = saved.get("seq", 0)
            self.seq_key = saved.get("seq_key", _LEGACY)
            if saved.get("local_labels") is not None:
                self.local_labels = np.asarray(saved["local_labels"], dtype=np.int64)

    def _saved(self) -> dict | None:
        """``slot.json`` as written (None: there is none), read as strictly as it is written: a regular
        file of at most MAX_STATE_BYTES, strict JSON, ``seq`` an integer in [0, 2^62], ``local_labels``
        a list of class ids, ``seq_key`` null or a sha256; a ValueError naming what is wrong otherwise (a FIFO hung the device, deep
        nesting was a RecursionError, 1e400 an OverflowError, and [[-5, 2.7]] were labels: a review's
        findings). The folder is the device's own; a slot it cannot read is the operator's to mend."""
        state = self.dir / STATE_FILE
        if not state.exists():
            return None
        data = read_regular_file(state, "the model slot's state", MAX_STATE_BYTES)
        try:
            saved = parse_strict_json(data)
        except (ValueError, RecursionError) as exc:
            raise ValueError(f"{state}: not a model slot's state: {exc}") from None
        if not isinstance(saved, dict):
            raise ValueError(f"{state}: not a model slot's state (a JSON object), but {type(saved).__name__}")
        seq, labels = saved.get("seq", 0), saved.get("local_labels")
        if type(seq) is not int or not 0 <= seq <= 2 ** 62:
            raise ValueError(f"{state}: seq must be an integer in [0, 2^62], got {str(seq)[:40]}")
        key = saved.get("seq_key")
        if key is not None and not (isinstance(key, str) and _SHA256.fullmatch(key)):
            raise ValueError(f"{state}: seq_key must be null or a sha256, got {str(key)[:40]}")
        if labels is not None and not (isinstance(labels, list) and all(type(c) is int and 0 <= c < 2 ** 31
                                                                          for c in labels)):
            raise ValueError(f"{state}: local_labels must be a list of class ids (integers >= 0)")
        for key in ("current", "previous"):     # a version's sha256 names its file: 64 hex digits, no path
            entry = saved.get(key)
            if entry is not None and not (isinstance(entry, dict) and _HEAD_FILE.fullmatch(f"{entry.get('sha256')}.npz")
                                          and isinstance(entry.get("deployment"), str)
                                          and isinstance(entry.get("bundle_sha256", ""), str)):
                raise ValueError(f"{state}: {key} must be a version (sha256, deployment, bundle_sha256)")
        return saved

    def predict(self, features: np.ndarray) -> np.ndarray:
        """Class ids for (n, d) features with the deployed head, OLL-pruned when the device
        personalises (ValueError with none deployed)."""
        head = self.current
        if head is None:
            raise ValueError("no model version is deployed on this device yet")
        return head.predict(features, self.local_labels)

    def correct(self, head: HeadVersion, features: np.ndarray, labels: np.ndarray) -> int:
        """How many of the labelled samples ``head`` gets right the way this device predicts."""
        return int((head.predict(features, self.local_labels) == np.asarray(labels)).sum())

    def swap(self, data: bytes, sha256: str, deployment: str, bundle_sha256: str = "") -> HeadVersion:
        """Make the verified head file ``data`` current, keeping the current one as previous."""
        W, b = D.head_from_npz(data, sha256)
        new = HeadVersion(sha256, deployment, W, b, bundle_sha256)
        with self._lock:
            self._commit(new, self.current, new_file=data)
        return new

    def relabel(self, deployment: str) -> None:
        """The current head, judged again under ``deployment`` (the same head deployed anew): from now
        on it came from that one, so that deployment's re-delivered assignment is a re-delivery and
        its rollback reverts it (a review's finding: it kept the old name, and every re-delivery of
        the new assignment was judged and reported again)."""
        with self._lock:
            if self.current is not None and self.current.deployment != deployment:
                self._commit(dataclasses.replace(self.current, deployment=deployment), self.previous)

    def revert(self, deployment: str) -> bool:
        """Back to the kept version if the current one came from ``deployment``; whether it did."""
        with self._lock:
            if self.current is None or self.current.deployment != deployment:
                return False
            self._commit(self.previous, None)
            return True

    def bind_key(self, aggregator_key: bytes | None) -> None:
        """The follower's aggregator key: a sequence held under another key (or under none, where
        anyone on the broker could publish an assignment) does not bind this one. A review's finding:
        an unsigned assignment of seq 2^62 accepted before the device had the key made it refuse every
        signed one after."""
        key_id = hashlib.sha256(aggregator_key).hexdigest() if aggregator_key else None
        with self._lock:
            if self.seq_key is _LEGACY:     # written before keys were recorded: taken as this key's
                self.seq_key = key_id
                self._commit(self.current, self.previous)
            elif key_id != self.seq_key:
                if self.seq:
                    log.warning("deployment sequence %d was accepted under another aggregator key: not held", self.seq)
                self.seq, self.seq_key = 0, key_id
                self._commit(self.current, self.previous)

    def hold_seq(self, seq: int) -> None:
        """Keep ``seq`` as the highest accepted (durable before the assignment is acted on: a
        restart cannot forget it and take an older one again)."""
        with self._lock:
            if seq > self.seq:
                self.seq = seq
                self._commit(self.current, self.previous)

    def _commit(self, current: HeadVersion | None, previous: HeadVersion | None, labels_only: bool = False,
                new_file: bytes | None = None) -> None:
        """Write the slot's state, holding the folder's lock: the application may open a slot of its
        own on it (to predict as this device does) while the follower swaps heads. What the other
        process wrote is read again under the lock: a labels-only commit keeps its heads and
        sequence (a stale one undid a swap and deleted the running head's file), a swap keeps the
        higher sequence, and only files that the state written names are kept. ``new_file``: the
        current head's file, written under the same lock (written before it, the application's
        labels-only commit could delete it as unnamed: a review's finding, the slot then unreadable)."""
        with _FolderLock(self.dir):
            labels = self.local_labels
            if labels_only:
                self._load()
                current, previous, self.local_labels = self.current, self.previous, labels
            elif (saved := self._saved()) is not None:      # a swap: the higher sequence, the application's labels
                self._merge(saved)
            if new_file is not None:
                if self.local_labels is not None:   # labels saved since the swap was judged: a head without
                    current.predict(np.zeros((0, current.W.shape[1])), self.local_labels)   # their classes: refused
                write_atomic(self.dir / f"{current.sha256}.npz", new_file)
            entry = (lambda h: None if h is None else {"sha256": h.sha256, "deployment": h.deployment,
                                                       "bundle_sha256": h.bundle_sha256})
            labels = None if self.local_labels is None else self.local_labels.tolist()
            write_atomic(self.dir / STATE_FILE, json.dumps({"current": entry(current), "previous": entry(previous),
                                                             "local_labels": labels, "seq": self.seq,
                                                             **({} if self.seq_key is _LEGACY else
                                                                {"seq_key": self.seq_key})}).encode())
            self.current, self.previous = current, previous
            keep = {f"{h.sha256}.npz" for h in (current, previous) if h is not None}
            for f in self.dir.iterdir():                        # versions neither kept nor running
                # only a head file this slot wrote (<sha256>.npz): the folder may hold the operator's
                # own files (a review found `--deployments DIR` deleted the user's best_model.npz)
                if _HEAD_FILE.fullmatch(f.name) and f.name not in keep:
                    f.unlink(missing_ok=True)

    def _merge(self, saved: dict) -> None:
        """What another slot saved that this one's commit keeps: the higher sequence under this key
        (another key's binds nobody; a slot holding a sequence of no key, written before keys were
        recorded, takes the key and sequence saved since, never writing a lower one without them),
        and the saved labels when this slot has none. The Java ModelSlot.commit is the same rule."""
        saved_key = saved.get("seq_key", _LEGACY)
        if self.seq_key is _LEGACY and saved_key is not _LEGACY:
            self.seq_key, self.seq = saved_key, max(self.seq, saved.get("seq", 0))
        elif saved_key in (self.seq_key, _LEGACY):
            self.seq = max(self.seq, saved.get("seq", 0))
        if self.local_labels is None and saved.get("local_labels") is not None:
            self.local_labels = np.asarray(saved["local_labels"], dtype=np.int64)

    def _read(self, entry: dict | None) -> HeadVersion | None:
        if not entry:
            return None
        data = read_regular_file(self.dir / f"{entry['sha256']}.npz", "a kept head", D.MAX_HEAD_BYTES)
        W, b = D.head_from_npz(data, entry["sha256"])
        return HeadVersion(entry["sha256"], entry["deployment"], W, b, entry.get("bundle_sha256", ""))


class _FolderLock:
    """A lock on ``folder`` (its ``.slot.lock``) across processes and threads: exclusive, or shared
    where this process may only read the folder (an application reading its slot from a read-only
    mount; where no lock file exists there, none is taken: nothing writes that folder).

    The lock is a POSIX record lock (``fcntl.lockf``), the kind the Java device's
    ``FileChannel.lock`` takes, so a Python and a Java slot on one folder exclude each other (on
    Linux an ``flock`` and a record lock do not see each other); an ``flock`` as well, the kind
    Python slots took before, for a slot of an older SDK beside this one. A record lock is the
    process's, not the open file's: a second slot of this process would take it again, and closing
    its file would drop the first's; so a threading lock per folder serialises the process's own
    slots first (forgotten in a forked child, where no thread would ever release it)."""

    _in_process: dict[str, threading.Lock] = {}
    _registry = threading.Lock()

    def __init__(self, folder: Path):
        self.path = folder / ".slot.lock"
        with _FolderLock._registry:
            self._threads = _FolderLock._in_process.setdefault(os.path.realpath(self.path), threading.Lock())

    def __enter__(self) -> "_FolderLock":
        self._threads.acquire()
        try:
            self.handle = self._locked()
        except BaseException:
            self._threads.release()
            raise
        return self

    def _locked(self):
        try:
            handle, kind = open(self.path, "a+b"), fcntl.LOCK_EX
        except OSError as exc:
            if exc.errno not in (errno.EROFS, errno.EACCES, errno.EPERM, errno.ENOSPC, errno.EDQUOT):
                raise
            try:
                handle, kind = open(self.path, "rb"), fcntl.LOCK_SH
            except FileNotFoundError:
                return None
        try:
            fcntl.lockf(handle, kind)
            fcntl.flock(handle, kind)
        except BaseException:
            handle.close()
            raise
        return handle

    def __exit__(self, *exc) -> None:
        try:
            if self.handle is not None:
                # unlocked before closed: a child forked meanwhile holds the same open file, and its
                # flock would outlive this close (its own slot then waiting on it for ever)
                fcntl.flock(self.handle, fcntl.LOCK_UN)
                fcntl.lockf(self.handle, fcntl.LOCK_UN)
                self.handle.close()
        finally:
            self._threads.release()

    @staticmethod
    def forget_in_child() -> None:
        _FolderLock._in_process, _FolderLock._registry = {}, threading.Lock()


os.register_at_fork(after_in_child=_FolderLock.forget_in_child)


def refusal_of(a: dict, device_id: str, held_seq: int) -> tuple[str, str] | None:
    """(reason class, why) when a signed assignment must be refused by device ``device_id`` holding
    sequence ``held_seq``; None when it may be acted on (the same sequence again is a retained
    re-delivery, not a replay: acting on it again changes nothing). The Java ``ModelSlot.admit``
    is the same rule (tests/test_java_deployment.py runs both on the same messages)."""
    if a["device"] != device_id:            # signed for another device, republished on this one's topic
        return "device", f"assignment {a['seq']} of {a['deployment']} is for {a['device']!r}, not this device: refused"
    if a["seq"] < held_seq:                 # a captured older assignment replayed: never back in time
        return "stale", f"assignment {a['seq']} of {a['deployment']} is older than the one held ({held_seq}): refused"
    return None


class DeploymentFollower(LinkWorker):
    """Follows the device's assignment: fetch, verify, evaluate on ``holdout(bundle_sha256)`` ->
    (features of the held-out split through that bundle, labels), swap, report. ``aggregator_key``:
    only assignments the aggregator signed are accepted."""

    def __init__(self, device_id: str, broker: BrokerConfig, slot: ModelSlot,
                 holdout: Callable[[str], tuple[np.ndarray, np.ndarray]], topics: Topics = Topics(),
                 aggregator_key: bytes | None = None, signer=None, fetch_timeout_s: float = 60.0,
                 retry_s: float = 5.0, client_id: str | None = None, refusal_interval_s: float = 10.0):
        # unread, the aggregator's deploy topics hold at most two of the largest heads here
        super().__init__(thread_name=f"{device_id}-deploy", tick_s=0.2,
                         bound=QueueBound(2 * (D.MAX_HEAD_BYTES + (1 << 20)), 4 * (D.MAX_HEAD_BYTES + (1 << 20))))
        slot.bind_key(aggregator_key)
        self.device_id, self.slot, self.holdout, self.topics, self.signer = device_id, slot, holdout, topics, signer
        self.fetch_timeout_s, self.retry_s, self.refusal_interval_s = fetch_timeout_s, retry_s, refusal_interval_s
        self._last_unbound: dict[str, float] = {}    # refusal class -> when one not about our assignment was reported
        # a head is the largest message here: nothing larger is held, nor for longer than a fetch may take
        self.assembler = aggregator_inbox(
            sender_verifier(AGGREGATOR_ID, aggregator_key) if aggregator_key else None,
            max_message_bytes=D.MAX_HEAD_BYTES + (1 << 20), max_pending_bytes=2 * (D.MAX_HEAD_BYTES + (1 << 20)),
            ttl_s=fetch_timeout_s)
        # the latest refusals and reports, for a status page or a test: bounded, since anyone on an open
        # broker can make the device refuse (a review's 500 forgeries held 33 MB of refusal text)
        self.refusals: collections.deque[str] = collections.deque(maxlen=KEPT_REFUSALS)
        self.reports: collections.deque[dict] = collections.deque(maxlen=KEPT_REFUSALS)
        self._pending: dict | None = None            # the run being fetched: assignment + when asked
        self._retry: dict | None = None              # a fetched head whose adoption failed on this side, tried again
        # its own account when the broker has them (BrokerConfig.for_role): one MQTT identity per connection
        broker = broker.for_role(DEPLOY_ROLE)
        self.link = MqttLink(client_id or broker.username or f"{device_id}.deploy", broker, on_message=self._post,
                             subscriptions=[(topics.deploy(device_id), 1), (topics.deploy_in(device_id), 1)])

    def _handle(self, item: tuple[str, bytes]) -> None:
        self._on_payload(*item)

    def _failed(self, item: tuple[str, bytes] | None, exc: Exception) -> None:
        if item is None:                    # a tick's error ends the thread, as it always has: only messages are isolated
            raise exc
        log.error("%s: deployment message raised", self.device_id, exc_info=exc)     # the device goes on

    def _on_payload(self, topic: str, payload: bytes) -> None:
        if not payload:                     # a retained message cleared: nothing is assigned
            return
        is_assignment = topic == self.topics.deploy(self.device_id)
        try:
            env = self.assembler.feed(payload)
            if env is None:
                return
            if env.sender != AGGREGATOR_ID:
                raise EnvelopeError(f"message from {env.sender!r}, expected the aggregator")
        except EnvelopeError as exc:     # not a message the aggregator signed: a forgery, or a tampered head
            what = "assignment" if is_assignment else "head"
            return self._refuse(f"{what} refused: {exc}", None if is_assignment else self._pending, "signature")
        try:
            if is_assignment:
                return self._on_assignment(D.parse_assignment(env))
            if env.type == ARTIFACT and self._pending is not None:
                self._on_head(env)
        except EnvelopeError as exc:
            self._refuse(f"assignment refused: {exc}", None, "load")

    def _on_assignment(self, a: dict) -> None:
        refusal = refusal_of(a, self.device_id, self.slot.seq)
        if refusal is not None:
            return self._refuse(refusal[1], None, refusal[0])
        redelivery = a["seq"] == self.slot.seq
        try:        # the same seq again: a retained re-delivery, handled below
            self.slot.hold_seq(a["seq"])
        except (OSError, ValueError) as exc:    # not durable (its slot.json unwritable or not a file), not
            # acted on: said, as the Java follower says it
            return self._refuse(f"assignment {a['seq']} not written: {exc}", None, "load")
        if self._retry is not None:
            if self._retry["a"]["seq"] == a["seq"]:     # its re-delivery: the held head is still being adopted
                return
            self._retry = None                          # a newer assignment replaces it
        if self._pending is not None and self._pending["seq"] != a["seq"]:
            # a newer assignment ends the older one's fetch, whatever it says: its head arriving later
            # (late, or replayed) swapped in a version the aggregator had since withdrawn (a review's finding)
            self._pending = None
        if a["action"] == D.ROLLBACK:
            try:
                if self.slot.revert(a["deployment"]):
                    log.warning("%s: deployment %s rolled back (%s): running the kept version again", self.device_id,
                                a["deployment"], a.get("reason", ""))
            except (OSError, ValueError) as exc:
                self._refuse(f"rollback of {a['deployment']} not written: {exc}", None, "load")
            return
        current, previous = self.slot.current, self.slot.previous
        kept = next((v for v in (current, previous) if v is not None and v.sha256 == a["sha256"]), None)
        if kept is current and current is not None and current.deployment == a["deployment"] and redelivery:
            return                                          # already running it (a retained re-delivery)
        # the current head in a new deployment, or under a new sequence (judged again, kept: the controller
        # asks anew after the device missed a rollback, e.g. its broker session lost), or the previous one
        if kept is not None:
            try:        # bounded and regular, as the slot reads its heads at start (ModelSlot._read)
                data = read_regular_file(self.slot.dir / f"{kept.sha256}.npz", "a kept head", D.MAX_HEAD_BYTES)
            except (OSError, ValueError) as exc:
                return self._refuse(f"kept head unreadable, staying on the current version: {exc}", a, "load")
            return self._adopt(a, data, swap=kept is not current)
        if self._pending is not None and self._pending["seq"] == a["seq"]:
            return          # its re-delivery while its head is fetched: the fetch's clock runs on (a review's
            # finding: a replay every minute kept the timeout refusal from ever being said, asking again each time)
        self._pending = {**a, "asked": 0.0, "since": time.monotonic()}

    def _tick(self, now: float) -> None:
        self.assembler.reassembler.expire()         # parts of a head that never completed
        r = self._retry
        if r is not None and now >= r["at"]:
            self._retry = None                      # held again only if this try fails on this side too
            self._adopt(r["a"], r["data"], r["swap"], r["since"])
        p = self._pending
        if p is None:
            return
        if now - p["since"] > self.fetch_timeout_s:
            self._pending = None
            return self._refuse(f"no head {p['sha256'][:16]}… within {self.fetch_timeout_s:g}s", p, "timeout")
        if now - p["asked"] >= self.retry_s:
            p["asked"] = now
            self.link.publish_envelope(self.topics.deploy_out(self.device_id), get_message(self.device_id, p["sha256"]),
                                       signer=self.signer)

    def _on_head(self, env) -> None:
        """Taken only as the answer to the assignment being fetched: its sha256 and its deployment's
        file name (a replayed head of another deployment is not this assignment's, even signed)."""
        p = self._pending
        if env.body.get("sha256") != p["sha256"] or env.body.get("name") != f"{p['deployment']}.npz":
            return
        self._pending = None
        try:
            _, data = parse_artifact(env, p["sha256"])
        except EnvelopeError as exc:    # a head that does not hash to the assignment, else no usable file
            return self._refuse(f"head refused, staying on the current version: {exc}", p,
                                "hash" if isinstance(exc, ArtifactDigestMismatch) else "load")
        self._adopt(p, data)

    def _adopt(self, a: dict, data: bytes, swap: bool = True, since: float | None = None) -> None:
        """Evaluate the candidate and the current head on the held-out split, swap, report the counts.
        A head that cannot be decoded, or does not fit the features, is refused at once: fetching it
        again gives the same bytes. What the device's own side fails at (the application's held-out
        features, writing the slot) may pass a moment later, so it is tried again every ``retry_s``
        and refused only once ``fetch_timeout_s`` has passed since the first failure: a refusal is
        the device's answer to the rollout, which a guard such as ``refused<=0`` rolls back on."""
        try:
            W, b = D.head_from_npz(data, a["sha256"])
        except Exception as exc:
            return self._cannot_load(a, exc)
        bundle, current = a.get("bundle_sha256", ""), self.slot.current
        candidate = HeadVersion(a["sha256"], a["deployment"], W, b, bundle)
        try:
            Z, y = self.holdout(bundle)
            # the current head is judged on its own bundle's features (the same ones, unless the bundle changed)
            Z_current = Z if current is None or current.bundle_sha256 == bundle else self.holdout(current.bundle_sha256)[0]
        except ENDS_THE_LOOP:
            raise
        # the application's held-out features: a BaseException of its own too is this try's failure (its
        # loop's policy, protocols/message_loop.py; the Java follower's for an Error), not one that drops
        # the assignment unanswered
        except BaseException as exc:
            return self._try_again(a, data, swap, since, f"held-out features: {type(exc).__name__}: {exc}")
        try:
            counts = {"n": len(y), "correct_candidate": self.slot.correct(candidate, Z, y),
                      "correct_current": self.slot.correct(current, Z_current, y) if current is not None else 0}
        except ENDS_THE_LOOP:
            raise
        except BaseException as exc:    # the head does not fit the bundle's features, or the device's labels
            return self._cannot_load(a, exc)
        try:
            if swap:
                self.slot.swap(data, a["sha256"], a["deployment"], bundle)
            else:                       # the current head under a new deployment: it came from that one now
                self.slot.relabel(a["deployment"])
        except OSError as exc:          # the slot's folder: full, or read-only for a while
            return self._try_again(a, data, swap, since, f"writing the slot: {type(exc).__name__}: {exc}")
        except Exception as exc:
            return self._cannot_load(a, exc)
        log.info("%s: now running %s of deployment %s (held-out %d/%d, was %d)", self.device_id, a["sha256"][:12],
                 a["deployment"], counts["correct_candidate"], counts["n"], counts["correct_current"])
        self._report(D.report_message(self.device_id, a["deployment"], a["sha256"], seq=a["seq"], **counts))

    def _cannot_load(self, a: dict, exc: BaseException) -> None:
        self._refuse(f"head cannot be loaded, staying on the current version: {type(exc).__name__}: {exc}", a, "load")

    def _try_again(self, a: dict, data: bytes, swap: bool, since: float | None, why: str) -> None:
        """Hold the verified head and adopt it again in ``retry_s``; refuse it, saying why, once
        ``fetch_timeout_s`` has passed since its first failure (``since``). Nothing is reported meanwhile."""
        now = time.monotonic()
        since = now if since is None else since
        if now - since >= self.fetch_timeout_s:
            return self._refuse(f"head not adopted within {self.fetch_timeout_s:g}s, staying on the current "
                                f"version: {why}", a, "load")
        log.warning("%s: head %s of deployment %s not adopted yet (%s): trying again in %gs", self.device_id,
                    a["sha256"][:12], a["deployment"], why, self.retry_s)
        self._retry = {"a": a, "data": data, "swap": swap, "since": since, "at": now + self.retry_s}

    def _refuse(self, why: str, a: dict | None, reason: str) -> None:
        """Log and report a refusal of class ``reason``. About the assignment being acted on (``a``
        is the held one), it is that assignment's answer; anything else (a forged, stale or
        misaddressed message) is reported against the version running, once per class per
        ``refusal_interval_s``: the operator learns of an attack, an attacker cannot make the
        device flood the aggregator. An assignment's own refusals: once per class."""
        why = why[:MAX_WHY_CHARS]           # a schema error quotes the field: a forged 60 KB type was 60 KB here
        log.warning("%s: %s", self.device_id, why)
        if a is None or a["seq"] != self.slot.seq:
            a = self._unbound_report_target(reason)
        elif reason in a.setdefault("refused_as", set()):     # forged heads while it is fetched: said once
            a = None
        else:
            a["refused_as"].add(reason)
        if a is not None:
            self._report(D.report_message(self.device_id, a["deployment"], a["sha256"], refused=why,
                                          seq=a["seq"], reason=reason))
        # recorded after its report: whoever sees the refusal (a status page, a test) sees the report
        self.refusals.append(why)

    def _unbound_report_target(self, reason: str) -> dict | None:
        now, current = time.monotonic(), self.slot.current
        if current is None or self.slot.seq == 0 or now - self._last_unbound.get(reason, -1e18) < self.refusal_interval_s:
            return None
        self._last_unbound[reason] = now
        return {"deployment": current.deployment, "sha256": current.sha256, "seq": self.slot.seq}

    def _report(self, env) -> None:
        self.reports.append(dict(env.body))
        self.link.publish_envelope(self.topics.deploy_out(self.device_id), env, signer=self.signer)
