"""The bundles a real device (``fedfleet device``) extracts features with: fetched from the aggregator
over the broker when a job names one, verified, kept within the disk budget, the failures remembered."""

from __future__ import annotations

import collections
import threading
from pathlib import Path


class BundleUnusable(Exception):
    """A bundle this device cannot extract features with, and why (``FetchedBundles.extractor_for``)."""


class FetchedBundles:
    """The device's extractor factory: a job that names a bundle (task param ``bundle_sha256``)
    gets that bundle, fetched from the aggregator over the broker the first time and verified
    file by file (``edge_client.artifacts.fetch_bundle``); a job that names none gets the bundle
    given at boot (``--bundle-sha``) or, without one, the local extractor (``--runtime``). A fetch
    in a task ends with the task's time (``work_deadline``), and a bundle that could not be fetched
    declines the next tasks naming it at once, with the same reason, for a few minutes
    (``edge_client.artifacts.UnavailableBundles``)."""

    def __init__(self, device_id: str, broker, topics, bundle_dir: Path, runtime: str, cache_dir: str | None,
                 default: str | None, local, aggregator_key: bytes | None = None, signer=None,
                 disk_budget_bytes: int | None = None):
        """``aggregator_key``: the device then takes only the aggregator's signed artifact replies;
        ``signer``: the device's, for its requests (an aggregator requiring signatures drops unsigned ones);
        ``disk_budget_bytes``: the most the fetched bundles may hold on disk (None: no bound)."""
        from edge_client.artifacts import UnavailableBundles
        from edge_client.disk_budget import DiskBudget
        from protocols.identity import sender_verifier
        from protocols.topics import AGGREGATOR_ID

        self.verifier = sender_verifier(AGGREGATOR_ID, aggregator_key) if aggregator_key else None
        self.signer = signer
        self.device_id, self.broker, self.topics = device_id, broker, topics
        self.bundle_dir, self.runtime, self.cache_dir = Path(bundle_dir), runtime, cache_dir
        self.default, self.local = default, local
        self.disk = DiskBudget(self.bundle_dir, disk_budget_bytes) if disk_budget_bytes is not None else None
        # manifest sha256 -> (extractor, weights sha256), for the last few bundles jobs named, most
        # recent last; a bundle on disk stays until the disk budget needs its room (never while held)
        self._held: collections.OrderedDict[str, tuple] = collections.OrderedDict()
        self.unavailable = UnavailableBundles()         # bundles a fetch could not bring, and why
        self.lock = threading.Lock()

    def get(self, sha: str):
        """(extractor, weights sha256) of bundle ``sha``, fetched unless held; its errors as they come
        (at boot, ``--bundle-sha``'s). Tasks and the follower ask through :meth:`extractor_for`."""
        with self.lock:
            return self._held_or_fetched(sha)

    def _held_or_fetched(self, sha: str):
        """:meth:`get`, under the bundle lock."""
        from edge_client.disk_budget import touch
        from edge_client.tasks.extractors import MAX_HELD_EXTRACTORS

        touch(self._folder(sha))                 # asked for: the last the disk budget removes
        if sha in self._held:
            self._held.move_to_end(sha)
            return self._held[sha]
        self._held[sha] = self._fetch(sha)
        if len(self._held) > MAX_HELD_EXTRACTORS:
            self._held.popitem(last=False)
        self._trim()
        return self._held[sha]

    def trim(self) -> None:
        """Keep the fetched bundles within the disk budget (the held ones stay)."""
        with self.lock:
            self._trim()

    def _trim(self) -> None:
        if self.disk is not None:
            self.disk.trim(keep={self._folder(sha) for sha in self._held})

    def _folder(self, sha: str) -> Path:
        return self.bundle_dir / sha[:16]

    def _fetch(self, sha: str):
        from edge_client.artifacts import MAX_BUNDLE_BYTES, fetch_bundle
        from edge_client.features import FeatureExtractor
        from edge_client.work_deadline import stop_if_past
        from protocols.topics import FETCH_ROLE

        stop_if_past()          # a task past its moment asks for nothing (the fetch ends with its time too)
        # its own MQTT identity (account {id}/fetch where the broker has accounts): the agent's
        # connection stays up while the bundle comes in
        broker = self.broker.for_role(FETCH_ROLE)
        # one bundle may hold no more than the whole disk budget: its manifest is refused before any
        # file is asked for (a review's finding: the budget only trimmed after a fetch, which could
        # write 2 GiB whatever --bundle-disk-mb said)
        largest = MAX_BUNDLE_BYTES if self.disk is None else min(MAX_BUNDLE_BYTES, self.disk.max_bytes)
        manifest = fetch_bundle(self.device_id, broker, sha, self._folder(sha), self.topics,
                                client_id=broker.username or f"{self.device_id}.fetch", verifier=self.verifier,
                                signer=self.signer, max_bundle_bytes=largest)
        extractor = FeatureExtractor.from_bundle(manifest, self.runtime, self.cache_dir, sha)
        if self.runtime == "auto":
            print(f"bundle {sha[:16]}: --runtime auto chose {extractor.runtime}; " + "; ".join(
                t.line() for t in extractor.calibration), flush=True)
        return extractor, extractor.weights_sha256     # the verified manifest's, not a re-read

    def extractor_for(self, sha: str):
        """(extractor, weights sha256) of bundle ``sha``, for a task and for the deployment follower's
        held-out features alike; :class:`BundleUnusable`, saying why, for a malformed digest, on a
        device running eager torch (it would fetch the bundle only to fail), and for a bundle that
        could not be fetched (remembered for a while: asked for again meanwhile, it is refused at once)."""
        from edge_client.artifacts import ArtifactFetchError
        from protocols.bundle_manifest import ArtifactError

        from protocols.envelope import EnvelopeError
        from protocols.payloads.artifacts import check_sha

        try:
            check_sha(sha)              # it becomes a directory name: nothing but 64 hex digits
        except EnvelopeError as exc:
            raise BundleUnusable(f"bad bundle_sha256: {exc}") from exc
        if self.runtime == "eager":
            raise BundleUnusable(f"job runs on bundle {sha[:16]}, but this device runs eager torch (use --runtime "
                                 "executorch or onnxruntime)")
        # the follower's thread and the tasks' both ask: the failures remembered are read and noted under
        # the bundle lock, so who waited behind a failing fetch of the same bundle is refused, not fetches again
        with self.lock:
            known = self.unavailable.reason(sha)
            if known is not None:       # failed a moment ago: the job's next task is not held up again
                raise BundleUnusable(known)
            try:
                return self._held_or_fetched(sha)
            except (ArtifactFetchError, ArtifactError, OSError, ValueError) as exc:
                # ArtifactError: a bundle with no program for this device's runtime, or a file whose digest
                # differs (a review's finding: they escaped as a task's unexpected error, with a traceback)
                reason = f"bundle {sha[:16]} unavailable: {exc}"
                self.unavailable.note(sha, reason)
                raise BundleUnusable(reason) from exc

    def __call__(self, backbone: str, image_size: int, weights: str, bundle_sha256: str = ""):
        from edge_client.agent import TaskDeclined

        sha = bundle_sha256 or self.default
        if not sha:
            if self.local is None:
                raise TaskDeclined("this device is torch-free (fedfleet[device]): it extracts features only with an "
                                   "exported bundle, and neither the job (bundle_sha256) nor --bundle-sha names one")
            return self.local(backbone, image_size, weights)
        try:
            extractor, bundle_weights = self.extractor_for(sha)
        except BundleUnusable as exc:
            raise TaskDeclined(str(exc)) from exc
        if image_size != extractor.image_size or (weights and weights != bundle_weights):
            raise TaskDeclined(f"job wants {backbone}@{image_size}px weights {weights[:12]}; bundle {sha[:16]} is "
                               f"{extractor.image_size}px weights {bundle_weights[:12]}")
        return extractor
