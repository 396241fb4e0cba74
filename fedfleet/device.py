"""``fedfleet device``: run one real device agent on local data (IDX files or an image folder)."""

from __future__ import annotations

import argparse
import collections
import signal
import threading
import time
from pathlib import Path
from types import SimpleNamespace

from .device_bundles import FetchedBundles
from .device_credentials import apply_credentials


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--id", default=None, help="device id (enrolled with the aggregator; default: the credentials')")
    p.add_argument("--credentials", type=Path, default=None,
                   help="the JSON enrolment returned (fedfleet admin device enroll ID --out FILE): the MQTT account, "
                        "the device's key, the broker's CA and the aggregator's key, so no flag needs them")
    p.add_argument("--broker", default="mqtt://127.0.0.1:1883",
                   help="mqtt://[user:pass@]host:port[?version=3.1.1|5] (the MQTT account from enrolment)")
    p.add_argument("--tls-ca", default=None,
                   help="CA file of the broker's TLS listener (mqtts://; default: the system's trusted CAs)")
    p.add_argument("--topic-root", default="fedfleet", help="first level of every fedfleet topic")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--image-folder", type=Path, help="root/<class>/*.png layout with any subset of --classes")
    src.add_argument("--idx", nargs=2, type=Path, metavar=("IMAGES", "LABELS"), help="IDX image and label files")
    p.add_argument("--classes", default=None, help="comma-separated global class list (image-folder mode)")
    p.add_argument("--image-size", type=int, default=None, metavar="PIXELS",
                   help="--image-folder: resize every image to PIXELS x PIXELS as it is read (the backbone's input "
                        "size, e.g. 224), so images of mixed sizes or orientations load and large photos take "
                        "little memory (default: images are kept as they are and must share one size)")
    p.add_argument("--image-memory-mb", type=float, default=IMAGE_FOLDER_MB,
                   help="--image-folder: the most the decoded images may take in memory; a larger folder is "
                        "refused before any image is decoded")
    p.add_argument("--cache-dir", default=None, help="where extracted features are cached (default: no cache)")
    p.add_argument("--runtime", default=None, choices=["eager", "executorch", "onnxruntime", "auto"],
                   help="how features are extracted: eager PyTorch, or an exported bundle's program; auto: the "
                        "bundle's fastest program on this device that keeps parity, by a short calibration "
                        "(default: eager, or auto on a torch-free device)")
    p.add_argument("--bundle-sha", default=None,
                   help="fetch this exported bundle (manifest sha256) from the aggregator at start, verify it, "
                        "and extract features with it (--runtime executorch|onnxruntime)")
    p.add_argument("--bundle-dir", type=Path, default=Path(".cache/bundle"), help="where the fetched bundle goes")
    p.add_argument("--bundle-disk-mb", type=float, default=1024.0,
                   help="the most the fetched bundles may take in --bundle-dir; the least recently used go first "
                        "(a bundle in use stays), and a bundle larger than this is refused before it is fetched")
    p.add_argument("--feature-cache-mb", type=float, default=256.0,
                   help="the most the feature cache may take in --cache-dir; the least recently used files go first")
    p.add_argument("--training-bundle", type=Path, default=None,
                   help="manifest.json of a head training bundle: FedAvg rounds train through its program")
    p.add_argument("--tail-bundle", type=Path, default=None,
                   help="manifest.json of a bundle exported with --tail-stages: serves FT(phi)/FT(M) rounds "
                        "(fedavg.tail) through its trunk and tail training programs")
    p.add_argument("--threads", type=int, default=None, help="CPU threads for inference and training")
    p.add_argument("--holdout-fraction", type=float, default=0.2,
                   help="share of the local data kept out of all training, for personalization (OLL) reports; "
                        "0 disables personalization tasks")
    p.add_argument("--seed", type=int, default=0, help="seed of the local train / held-out split")
    kept = p.add_mutually_exclusive_group()
    kept.add_argument("--state-dir", type=Path, default=None,
                      help="where this device keeps per-job state between rounds (partial personalization's "
                           "personal part, Scaffold's control variate) and the windows of samples its Fed3R answers "
                           "covered: stateful tasks need it, and so do Fed3R tasks over fewer than all its samples "
                           "(DP caps, streaming); created with mode 0700 (default: $FEDFLEET_STATE_HOME/ID, else "
                           "$XDG_STATE_HOME/fedfleet/devices/ID, else ~/.local/state/fedfleet/devices/ID)")
    kept.add_argument("--no-state", action="store_true",
                      help="keep no state folder: stateful tasks and Fed3R tasks over fewer than all its samples "
                           "are declined")
    p.add_argument("--state-budget-mb", type=float, default=16.0,
                   help="the most state all jobs together may keep in the state folder; a job needing more is "
                        "declined")
    p.add_argument("--forget-state", action="store_true",
                   help="delete every job's state in the state folder (--state-dir, else the default) and exit "
                        "(the operator forgot this device)")
    p.add_argument("--identity", type=Path, default=None,
                   help="this device's Ed25519 private key (PEM): sign every message, take part in secure rounds")
    p.add_argument("--deployments", type=Path, default=None, metavar="DIR",
                   help="follow model rollouts: keep the deployed head (and the one it replaced) in DIR, judge each "
                        "candidate on the held-out split and report the counts (fedfleet admin model deploy)")
    p.add_argument("--personalize", action="store_true",
                   help="with --deployments: predict with the deployed head pruned to this device's training labels "
                        "(OLL), and judge each candidate and the current head that way")
    p.add_argument("--aggregator-key", default=None,
                   help="the aggregator's Ed25519 public key (hex, from enrolment): only messages it signed are "
                        "accepted, and secure aggregation rounds need it (default: unverified, development)")
    p.add_argument("--secure-only", action="store_true",
                   help="send updates and statistics only through secure aggregation: decline every task that would "
                        "send them in the clear (fed3r.stats, fedavg.head, ...), whoever asks (needs --identity and "
                        "--aggregator-key)")


def run_device(args) -> int:
    # The device path uses edge_client only (its handlers: edge_client.handlers, the same builder
    # the emulated fleet uses); nothing from aggregator or fedfleet.emulation.
    from edge_client.disk_budget import DiskBudget
    from edge_client.handlers import Unsupported

    from .device_state_path import remove_made

    if args.forget_state:
        return forget_state(args)
    _check_device_arguments(args)
    made_folders = state_folder(args, create=True)
    # a start that fails (data it cannot load: a bad --idx path or file; a bundle, identity or broker
    # refused) takes back the state folder it made while still empty: it left one behind (a review's finding)
    try:
        device = _start_device(args)
    except BaseException:
        remove_made(made_folders)
        raise
    print(f"device {args.id}: {len(device.train_idx)} training / {len(device.holdout_idx)} held-out samples, tasks "
          f"{sorted(k for k, h in device.handlers.items() if not isinstance(h, Unsupported))}"
          f"{sorted(k for k in device.protocol_handlers if '.' in k)}", flush=True)
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    feature_cache = DiskBudget(Path(args.cache_dir), _megabytes(args.feature_cache_mb), "features-*.npy") \
        if args.cache_dir else None
    while True:         # from the start, then every DISK_CHECK_S: the cache grows with every task
        device.extractors.trim()       # (bundles are also trimmed at each fetch)
        if feature_cache is not None:
            feature_cache.trim()
        if stop.wait(DISK_CHECK_S):
            break
    device.agent.stop()
    if device.follower is not None:
        device.follower.stop()
    return 0


def _start_device(args) -> SimpleNamespace:
    """The device's data, bundles, handlers, agent and deployment follower, started."""
    import numpy as np

    from edge_client.agent import DeviceAgent
    from edge_client.artifacts import ArtifactFetchError
    from edge_client.data.split import train_holdout_split
    from edge_client.handlers import HandlerConfig, LocalData, SharedExtractors, device_handlers, secure_only, \
        torch_free
    from protocols.mqtt_link import BrokerConfig
    from protocols.topics import Topics

    from .errors import UserError

    images, labels = _local_images(args)
    train_idx, holdout_idx = train_holdout_split(np.arange(len(labels)), args.holdout_fraction, args.seed)
    broker = BrokerConfig.from_url(args.broker, tls_ca=args.tls_ca)
    # Without torch there is no local export: features come only from a bundle (--bundle-sha or the job's).
    local = None if torch_free() else SharedExtractors(_local_factory(args.runtime, args.cache_dir), args.cache_dir)
    identity = _identity(args)
    extractors = FetchedBundles(args.id, broker, Topics(args.topic_root), args.bundle_dir, args.runtime,
                                args.cache_dir, default=args.bundle_sha, local=local,
                                aggregator_key=bytes.fromhex(args.aggregator_key) if args.aggregator_key else None,
                                signer=identity.sign if identity is not None else None,
                                disk_budget_bytes=_megabytes(args.bundle_disk_mb))
    if args.bundle_sha:
        try:
            extractors.get(args.bundle_sha)      # at boot: fail early on a bad or unreachable bundle
        except ArtifactFetchError as exc:        # one line, not a traceback: the operator's to mend
            raise UserError(f"--bundle-sha: {exc}") from None
    handlers = device_handlers(LocalData(images, labels, train_idx, holdout_idx), extractors,
                               HandlerConfig(str(args.training_bundle) if args.training_bundle else None,
                                             str(args.tail_bundle) if args.tail_bundle else None),
                               state=(state := state_store(args)))
    signer, protocol_handlers = _signing(args, identity, handlers, state)
    if args.secure_only:        # after the secure handlers, which wrap the plain ones
        handlers = secure_only(handlers)
    agent = DeviceAgent(args.id, broker, handlers, Topics(args.topic_root), signer=signer,
                        protocol_handlers=protocol_handlers, state=state,
                        aggregator_key=bytes.fromhex(args.aggregator_key) if args.aggregator_key else None).start()
    follower = None
    if args.deployments:
        follower = follow_deployments(args, broker, extractors, images[holdout_idx], labels[holdout_idx], signer,
                                      labels[train_idx] if args.personalize else None)
    return SimpleNamespace(agent=agent, follower=follower, extractors=extractors, handlers=handlers,
                           protocol_handlers=protocol_handlers, train_idx=train_idx, holdout_idx=holdout_idx)


# the default cap on a decoded image folder (edge_client.data.image_folder.MAX_FOLDER_BYTES, not imported
# here: building the parser must not import the data readers)
IMAGE_FOLDER_MB = 4096.0
# the longest a deployment follower waits for a bundle an assignment names (its held-out features): the
# follower's own fetch window (DeploymentFollower.fetch_timeout_s), as a task's fetch ends with its deadline
HELD_OUT_FETCH_S = 60.0
DISK_CHECK_S = 30.0      # how often a running device trims its feature cache and fetched bundles


def _megabytes(mb: float) -> int:
    return int(mb * 2**20)


def _check_device_arguments(args) -> None:
    """Refuse what cannot work before any data is loaded (and fill what enrolment gave)."""
    from edge_client.handlers import torch_free
    from protocols.mqtt_link import BrokerConfig

    from .errors import UserError

    if args.personalize and not args.deployments:
        raise UserError("--personalize applies to the deployed head: it needs --deployments DIR")
    if args.threads is not None and args.threads < 1:       # (before the data is loaded)
        raise UserError("--threads must be >= 1")
    if not 0 <= args.holdout_fraction < 1:
        raise UserError("--holdout-fraction must be in [0, 1)")
    if args.image_size is not None and not 1 <= args.image_size <= 8192:
        raise UserError(f"--image-size must be between 1 and 8192 pixels, got {args.image_size}")
    for flag in ("bundle_disk_mb", "feature_cache_mb", "image_memory_mb"):
        if not 1 <= getattr(args, flag) <= 2**30:        # also refuses NaN
            raise UserError(f"--{flag.replace('_', '-')} must be a size in MB between 1 and 2^30, "
                            f"got {getattr(args, flag)}")
    if args.credentials:
        apply_credentials(args)
    if args.id is None:
        raise UserError("a device needs --id (or --credentials from enrolment)")
    BrokerConfig.from_url(args.broker)            # a bad address fails before the data is loaded
    if args.secure_only and not (args.identity and args.aggregator_key):
        raise UserError("--secure-only answers only secure rounds, which need --identity and --aggregator-key")
    if args.runtime is None:
        args.runtime = "auto" if torch_free() else "eager"
    if torch_free() and args.runtime in ("eager", "executorch"):
        raise UserError(f"--runtime {args.runtime} needs torch; this device is torch-free (fedfleet[device]): "
                        "use --runtime onnxruntime, or install 'fedfleet[device-executorch]'")


def _local_images(args):
    """The device's own labelled images (IDX files or an image folder), with its thread count set."""
    from edge_client.data import load_idx_dataset
    from edge_client.data.image_folder import ImageFolderTooLargeError, MixedImageSizesError, load_image_folder

    from .errors import UserError

    if args.idx:
        images, labels = load_idx_dataset(*args.idx)
    else:
        if not args.classes:
            raise UserError("--image-folder needs --classes (the job's class names, in order): ids taken from "
                            "the folders present would mislabel a device that holds only some classes")
        size = (args.image_size, args.image_size) if args.image_size else None
        try:
            images, labels, _ = load_image_folder(args.image_folder, size, args.classes.split(","),
                                                  max_bytes=_megabytes(args.image_memory_mb))
        except MixedImageSizesError as exc:
            raise UserError(f"--image-folder: {exc.detail}; pass --image-size PIXELS (the "
                            "backbone's input size, e.g. 224) to resize every image as it is read") from None
        except ImageFolderTooLargeError as exc:
            raise UserError(f"--image-folder: {exc} (--image-memory-mb); pass --image-size PIXELS (the backbone's "
                            "input size, e.g. 224) to keep each image that small, or raise --image-memory-mb") \
                from None
    if args.threads is not None:
        set_threads(args.runtime, args.threads)
    return images, labels


def _identity(args):
    """The device's signing identity (``--identity``), or None."""
    if not args.identity:
        return None
    from protocols.identity import DeviceIdentity

    from protocols.regular_file import OPTION_FILE_BYTES, read_regular_file

    return DeviceIdentity.from_pem(args.id, read_regular_file(args.identity, "--identity", OPTION_FILE_BYTES))


def _signing(args, identity, handlers: dict, state=None) -> tuple:
    """(signer, protocol handlers): the device's signature and, with the aggregator's key, the
    secure-aggregation handlers around its task handlers; (None, {}) without an identity."""
    from edge_client.handlers import secure_handlers

    if identity is None:
        return None, {}
    if not args.aggregator_key:
        return identity.sign, {}
    return identity.sign, secure_handlers(identity, bytes.fromhex(args.aggregator_key), handlers, state)


def state_folder(args, create: bool) -> list[Path]:
    """Puts the device's state folder in ``args.state_dir``: --state-dir, else the device's own default
    folder (``fedfleet/device_state_path.py``); None with --no-state. ``create``: made (mode 0700) if
    missing, and said once where the state lives. Returns the folders made here, for
    ``device_state_path.remove_made`` should the device not start."""
    from .device_state_path import default_state_dir, make_private_dir

    if args.no_state:
        if create:
            print(f"device {args.id} keeps no state (--no-state): stateful tasks and Fed3R tasks over fewer than "
                  "all its samples are declined", flush=True)
        return []
    if args.state_dir is None:
        args.state_dir = default_state_dir(args.id)
    if not create:
        return []
    made = make_private_dir(args.state_dir)
    print(f"device {args.id} keeps its state in {args.state_dir}", flush=True)
    return made


def state_store(args):
    """The device's per-job state store (``edge_client.state``) in its state folder, or None."""
    from edge_client.state import DeviceStateStore

    from .errors import UserError

    if args.state_dir is None:
        return None
    if not 0 <= args.state_budget_mb <= 1 << 20:
        raise UserError("--state-budget-mb must be in [0, 1048576]")
    return DeviceStateStore(args.state_dir, int(args.state_budget_mb * 2**20))


def forget_state(args) -> int:
    from .errors import UserError

    if args.no_state:
        raise UserError("--forget-state with --no-state: there is no state folder to forget")
    if args.state_dir is None and args.credentials:
        apply_credentials(args)             # the device id names its default folder (an --id it contradicts: refused)
    if args.state_dir is None and args.id is None:
        raise UserError("--forget-state needs --id (or --credentials) to find the device's state folder, "
                        "or --state-dir DIR")
    state_folder(args, create=False)
    folder = args.state_dir
    from edge_client.state import DeviceStateStore

    gone = DeviceStateStore(folder).forget() if folder.exists() else 0
    print(f"device state in {folder}: {gone} file(s) removed", flush=True)
    return 0


def follow_deployments(args, broker, extractors, holdout_images, holdout_labels, signer, local_labels=None):
    """Follow the device's rollout assignment (``edge_client.deployment``): a candidate head is judged on
    the held-out split's features through the bundle it names (else --bundle-sha's); OLL-pruned to
    ``local_labels`` (the training labels) when the device personalises."""
    from edge_client.deployment import DeploymentFollower, ModelSlot
    from edge_client.tasks.extractors import MAX_HELD_EXTRACTORS
    from edge_client.work_deadline import working_until
    from protocols.topics import Topics

    # bundle sha256 -> its held-out features, for as many bundles as the device keeps programs, the least
    # recently asked for leaving first: every assignment may name a new bundle, and kept whole they grew
    # with each one for the process's life (a review's finding); asked for again, they are extracted again
    features: collections.OrderedDict[str, object] = collections.OrderedDict()

    def holdout(bundle_sha: str):
        sha = bundle_sha or args.bundle_sha
        if not sha:
            raise ValueError("the head names no bundle and this device has no --bundle-sha to read features with")
        if sha in features:
            features.move_to_end(sha)
        else:
            # no task's deadline bounds a fetch on the follower's thread: without its own window it waited
            # 120 s a file, holding the bundle lock every task's extractor waits on (a review's finding).
            # Asked as a task asks (extractor_for): an eager device is refused before any fetch, and a
            # bundle that just failed is not fetched again at each retry; BundleUnusable is the follower's
            # held-out failure (tried again, then refused)
            with working_until(time.time() + HELD_OUT_FETCH_S):
                extractor = extractors.extractor_for(sha)[0]
            features[sha] = extractor.extract(holdout_images)
            while len(features) > MAX_HELD_EXTRACTORS:
                features.popitem(last=False)
        return features[sha], holdout_labels

    slot = ModelSlot(args.deployments, local_labels)
    if slot.current is not None:
        print(f"device {args.id}: running head {slot.current.sha256[:12]} of deployment {slot.current.deployment}",
              flush=True)
    return DeploymentFollower(args.id, broker, slot, holdout, Topics(args.topic_root), signer=signer,
                              aggregator_key=bytes.fromhex(args.aggregator_key) if args.aggregator_key else None).start()


def set_threads(runtime: str, threads: int) -> None:
    """Size every installed runtime's thread pool: numpy's BLAS (the numpy head step: on a busy
    2-core machine a 2-thread OpenBLAS made it 14x slower than one thread), torch's (eager, head
    training), ONNX Runtime's, and ExecuTorch's (XNNPACK ignores torch's setting)."""
    from threadpoolctl import threadpool_limits

    from edge_client.runtime.errors import RuntimeUnavailableError
    from edge_client.runtime.onnx_runtime import set_onnxruntime_threads

    threadpool_limits(threads)                    # process-wide: BLAS / OpenMP pools already loaded
    set_onnxruntime_threads(threads)
    try:
        import torch
    except ImportError:
        return
    torch.set_num_threads(threads)
    if runtime in ("executorch", "auto"):
        from edge_client.runtime.executorch_runtime import set_executorch_threads

        try:
            set_executorch_threads(threads)
        except RuntimeUnavailableError:
            if runtime == "executorch":
                raise


def _local_factory(runtime: str, cache_dir: str | None):
    """Extractors the device makes itself (eager torch, or a bundle it exports): needs torch."""
    def make(backbone: str, image_size: int):
        from .bundles import make_extractor

        return make_extractor(backbone, image_size, cache_dir, runtime, threads=None)

    return make
