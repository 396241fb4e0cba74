"""Fetch an exported bundle from the aggregator over the broker, verifying every byte.

A device provisions its model at boot, before its agent starts: it asks for the manifest by the
sha256 the operator (or the job) announced, then for every file the manifest lists, by the
digest the manifest gives, and writes them to ``dest`` under the manifest's names (the name an
``artifact`` reply gives is not the device's to trust: the digest is). Anything that does not hash
to what was asked for is refused and nothing is written under the final name. The result is then loaded with
``edge_client.runtime.load_inference(dest / "manifest.json", expected_manifest_sha256=...)``.

A device enrolled with the aggregator's key (``verifier``) takes only the aggregator's signed
messages, chunk by chunk, as its agent does; anyone else's are dropped unheld (a review's finding:
without it one forged "missing", or one forged file, ended the fetch, and the device declined every
task of the job; forged chunks held half a GB and the slots the real file needed). Without the key a
device trusts whatever its broker delivers, here as in its agent, but holds no more than it asked
for: a reply may be as large as a manifest may be (``MAX_MANIFEST_BYTES``) or as the manifest says
the file is, not the 512 MiB any message may be, and one sender's partial messages together no
larger than one reply (one partial at a time: a new message's first chunk takes the room of the
one before, so a replayed chunk of an earlier message never keeps the reply out).

The manifest is read as every manifest is (``protocols.bundle_manifest``: the schema, at most 32
files, each a plain name listed once and never ``manifest.json``) before any file is asked for, and
the files together may hold no more than ``max_bundle_bytes`` (2 GiB unless told less; a bundle
is tens of MB): a manifest that is not one, or names more than that, is one clear refusal before
anything is fetched. Each file is written as it arrives and the manifest last, so a fetch cut
short leaves no bundle that loads and never holds more than one file in memory. A file already in
``dest`` is replaced, and so is a folder under a file's name (a rename alone cannot replace it).
"""

from __future__ import annotations

import collections
import queue
import time
from pathlib import Path

from edge_client.disk_budget import remove_entry
from edge_client.inbox import aggregator_inbox
from edge_client.work_deadline import seconds_left
from protocols.bundle_manifest import MANIFEST_FILENAME, MAX_MANIFEST_BYTES, ManifestError, parse_manifest
from protocols.envelope import MAX_HEADER_BYTES, EnvelopeError
from protocols.files import write_atomic
from protocols.mqtt_link import BrokerConfig, MqttLink
from protocols.payloads.artifacts import ARTIFACT, MISSING, answers_ask, get_message, parse_artifact
from protocols.topics import AGGREGATOR_ID, Topics


# an artifact reply is the file plus its envelope: a header (at most MAX_HEADER_BYTES) and the prefix
REPLY_OVERHEAD_BYTES = MAX_HEADER_BYTES + 1024
MAX_BUNDLE_BYTES = 2 << 30              # what a bundle's files may hold together unless told less
# A sender's partial messages held at once: one. A reply is the one message a fetch waits for, and
# each partial may hold up to a reply's size, so 4 (the chunking default) let one sender pin 4x the
# file (a review's finding); with one, a chunk of another message takes the room of the partial
# before it, so a replayed chunk of an earlier message, landed first, never leaves the reply none
# (one slipped into the middle of the reply restarts it: the fetch asks again, and a replayer on
# the path could drop the reply anyway). The aggregator publishes a message's chunks one after
# another (its service thread sends whole messages), so its reply never interleaves with its
# other messages on the device's inbox
MAX_PENDING_REPLIES = 1
FETCH_TIMEOUT_S = 120.0                 # a file's fetch gives up after this (a task's: its time left, if less)
UNAVAILABLE_FOR_S = 300.0               # how long a device remembers a bundle it could not fetch
MAX_UNAVAILABLE = 16                    # bundles remembered so at once (a job names one)


class ArtifactFetchError(RuntimeError):
    """The bundle could not be fetched intact (timeout, refusal, or a digest mismatch)."""


class UnavailableBundles:
    """Bundles a device could not fetch, each with why, for ``for_s`` after the failure: a job's later
    tasks decline at once with that reason instead of each waiting out a fetch again (a review's
    finding: every task of a job whose bundle the aggregator did not serve waited 120 s a file).
    Past ``for_s`` the bundle is asked for again (the aggregator may have it by then). At most
    ``limit`` are kept, the oldest failure leaving first."""

    def __init__(self, for_s: float = UNAVAILABLE_FOR_S, limit: int = MAX_UNAVAILABLE):
        self.for_s, self.limit = for_s, limit
        self._until: collections.OrderedDict[str, tuple[float, str]] = collections.OrderedDict()

    def note(self, sha: str, reason: str, now: float | None = None) -> None:
        now = time.monotonic() if now is None else now
        self._until.pop(sha, None)
        self._until[sha] = (now + self.for_s, reason)
        while len(self._until) > self.limit:
            self._until.popitem(last=False)

    def reason(self, sha: str, now: float | None = None) -> str | None:
        """Why ``sha`` could not be fetched, while that is remembered; else None."""
        self.expire(time.monotonic() if now is None else now)
        held = self._until.get(sha)
        return None if held is None else held[1]

    def expire(self, now: float) -> None:
        """Forget the failures remembered until before ``now``."""
        for sha in [sha for sha, (until, _) in self._until.items() if until <= now]:
            del self._until[sha]


def _hint(reason: str) -> str:
    """What to do about a drop that looks like a configuration mismatch, not an attack."""
    if reason.startswith(f"unsigned message from {AGGREGATOR_ID!r}"):
        return (" (an aggregator run without --identity signs nothing, and a device given its key takes only "
                "signed messages: run the aggregator with --identity, or the device without --aggregator-key)")
    return ""


def _no_folder_at(path: Path) -> None:
    """Remove a folder standing where a bundle's file goes, as a stale file there is replaced: a rename
    cannot replace a folder (a review's finding: each fetch of that bundle failed, IsADirectoryError,
    after fetching it whole, until someone removed the folder). OSError when it cannot go whole."""
    if path.is_dir() and not path.is_symlink():
        remove_entry(path)


def fetch_bundle(device_id: str, broker: BrokerConfig, manifest_sha256: str, dest: Path,
                 topics: Topics = Topics(), timeout_s: float = FETCH_TIMEOUT_S, retry_s: float = 5.0,
                 signer=None, client_id: str | None = None, verifier=None,
                 max_bundle_bytes: int = MAX_BUNDLE_BYTES) -> Path:
    """``client_id``: the MQTT client id of the fetch (default: the device id). A running agent
    holds that id already, so fetching on demand needs another one (same account and topics).
    ``verifier``: the aggregator's (``protocols.identity.sender_verifier``), when the device has its key.
    ``max_bundle_bytes``: the most the manifest's files may hold together. In a task's work
    (``edge_client.work_deadline``) each file is waited for no longer than the task may still work:
    its answer is not waited for after that (a review's finding: 120 s a file, whatever the deadline)."""
    dest = Path(dest)
    inbox: queue.Queue = queue.Queue()
    link = MqttLink(client_id or device_id, broker, on_message=lambda t, p: inbox.put(p),
                    subscriptions=[(topics.inbox(device_id), 1)], clean_start=True)
    link.start()
    try:
        def fetch(sha: str, size_bytes: int) -> tuple[str, bytes]:
            # what the reply may hold is what was asked for, whoever sends chunks (a device without the
            # key takes anyone's): a manifest's bound, or the size its manifest gave the file; and all
            # one sender may have held, one such reply (MAX_PENDING_REPLIES)
            reply_bytes = size_bytes + REPLY_OVERHEAD_BYTES
            assembler = aggregator_inbox(verifier, max_message_bytes=reply_bytes,
                                         max_pending_per_sender=MAX_PENDING_REPLIES,
                                         max_pending_bytes_per_sender=MAX_PENDING_REPLIES * reply_bytes)
            left = seconds_left()
            wait_s = timeout_s if left is None else min(timeout_s, left)
            deadline = time.monotonic() + wait_s
            next_ask = 0.0
            dropped: list[str] = []              # why the last dropped message was: said at the timeout
            asked: set[str] = set()              # this fetch's asks: only an answer to one ends it
            while time.monotonic() < deadline:
                if time.monotonic() >= next_ask:  # ask again now and then: the aggregator may be (re)starting
                    ask = get_message(device_id, sha)
                    asked.add(ask.id)
                    link.publish_envelope(topics.outbox(device_id), ask, signer=signer)
                    next_ask = time.monotonic() + retry_s
                try:
                    env = assembler.feed(inbox.get(timeout=0.5))
                except queue.Empty:
                    continue
                except EnvelopeError as exc:     # not ours / malformed: keep waiting
                    dropped[:] = [str(exc)]
                    continue
                if env is None or env.sender != AGGREGATOR_ID or env.body.get("sha256") != sha:
                    continue
                if env.type == MISSING and answers_ask(env, asked):
                    raise ArtifactFetchError(f"the aggregator holds no artifact {sha[:16]}…")
                if env.type != ARTIFACT:
                    continue
                try:
                    return parse_artifact(env, sha)
                except EnvelopeError as exc:
                    raise ArtifactFetchError(str(exc)) from exc
            raise ArtifactFetchError(f"no artifact {sha[:16]}… from the aggregator within {wait_s:.3g}s"
                                     + (f"; a message was dropped: {dropped[0]}{_hint(dropped[0])}" if dropped else ""))

        _, manifest_bytes = fetch(manifest_sha256, MAX_MANIFEST_BYTES)
        try:
            manifest = parse_manifest(manifest_bytes, dest / MANIFEST_FILENAME)
        except ManifestError as exc:
            raise ArtifactFetchError(f"bundle {manifest_sha256[:16]}…: {exc}") from exc
        _fetch_files(fetch, manifest, manifest_sha256, dest, max_bundle_bytes)
    finally:
        link.stop()
    write_atomic(dest / MANIFEST_FILENAME, manifest_bytes)     # last: only a whole bundle has one
    return dest / MANIFEST_FILENAME


def _fetch_files(fetch, manifest, manifest_sha256: str, dest: Path, max_bundle_bytes: int) -> None:
    """The manifest's files, each fetched by its digest (``fetch(sha, size)``) and written under its
    names in ``dest``: refused whole when they would hold more than ``max_bundle_bytes``."""
    total = sum(spec.size_bytes for spec in manifest.artifacts)
    if total > max_bundle_bytes:
        raise ArtifactFetchError(f"bundle {manifest_sha256[:16]}… lists {total} bytes of files, more than "
                                 f"the {max_bundle_bytes} this device takes for a bundle")
    dest.mkdir(parents=True, exist_ok=True)
    for name in [spec.file for spec in manifest.artifacts] + [MANIFEST_FILENAME]:
        _no_folder_at(dest / name)          # before anything is fetched: a removal that fails costs no fetch
    # A file is asked for by its sha256 alone, so of files with the same bytes (in one bundle or
    # two) the aggregator answers under any of their names: each is written under its manifest's
    # names, whatever name the reply gives (a review's finding: the device refused the other
    # name, and never got the bundle). Same bytes are asked for once: the aggregator answers a
    # device's asks for one file only twice in 30 s (its ARTIFACT_RESEND_S)
    specs_by_digest: dict[str, list] = {}
    for spec in manifest.artifacts:
        specs_by_digest.setdefault(spec.sha256, []).append(spec)
    for sha, specs in specs_by_digest.items():
        _, data = fetch(sha, specs[0].size_bytes)
        for name in (spec.file for spec in specs):
            write_atomic(dest / name, data)  # write-then-rename: no half-written file is ever used
        del data                             # freed before the next file arrives
