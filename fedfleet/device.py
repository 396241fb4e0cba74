"""``fedfleet device``: run one real device agent on local data (IDX files or an image folder)."""

from __future__ import annotations

import argparse
import signal
import threading
from pathlib import Path


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--id", required=True, help="device id (enrolled with the aggregator)")
    p.add_argument("--broker", default="mqtt://127.0.0.1:1883")
    p.add_argument("--tls-ca", default=None)
    p.add_argument("--topic-root", default="fedfleet")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--image-folder", type=Path, help="root/<class>/*.png layout; class ids = sorted names")
    src.add_argument("--idx", nargs=2, type=Path, metavar=("IMAGES", "LABELS"), help="IDX image and label files")
    p.add_argument("--classes", default=None, help="comma-separated global class list (image-folder mode)")
    p.add_argument("--cache-dir", default=None)
    p.add_argument("--runtime", default="eager", choices=["eager", "executorch", "onnxruntime"])
    p.add_argument("--bundle-sha", default=None,
                   help="fetch this exported bundle (manifest sha256) from the aggregator at start, verify it, "
                        "and extract features with it (--runtime executorch|onnxruntime)")
    p.add_argument("--bundle-dir", type=Path, default=Path(".cache/bundle"), help="where the fetched bundle goes")


def run_device(args) -> int:
    # The device path uses edge_client only; the emulation worker's helpers are shared on purpose
    # (one definition of "how a device builds its extractor"), but import nothing from aggregator.
    import json

    from edge_client.agent import DeviceAgent, TaskDeclined
    from edge_client.data import load_idx_dataset
    from edge_client.data.image_folder import load_image_folder
    from edge_client.tasks.fed3r_stats import Fed3RStatsTask
    from protocols.mqtt_link import BrokerConfig
    from protocols.topics import Topics

    from .emulation.worker import SharedExtractors

    if args.idx:
        images, labels = load_idx_dataset(*args.idx)
    else:
        classes = args.classes.split(",") if args.classes else None
        images, labels, _ = load_image_folder(args.image_folder, classes=classes)
    broker = BrokerConfig.from_url(args.broker, tls_ca=args.tls_ca)
    extractors = SharedExtractors(args.cache_dir, args.runtime, threads=None)
    if args.bundle_sha:
        from edge_client.artifacts import fetch_bundle

        from .bundles import extractor_from_manifest

        manifest = fetch_bundle(args.id, broker, args.bundle_sha, args.bundle_dir, Topics(args.topic_root))
        fetched = extractor_from_manifest(manifest, args.runtime, args.cache_dir, args.bundle_sha)
        bundle_weights = json.loads(manifest.read_text())["backbone"]["weights_sha256"]

        def extractors(backbone: str, size: int, weights: str):
            if size != fetched.image_size or (weights and weights != bundle_weights):
                raise TaskDeclined(f"job wants {backbone}@{size}px weights {weights[:12]}; the fetched bundle is "
                                   f"{fetched.image_size}px weights {bundle_weights[:12]}")
            return fetched
    handler = Fed3RStatsTask(images, labels, extractors)
    agent = DeviceAgent(args.id, broker, {"fed3r.stats": handler}, Topics(args.topic_root)).start()
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    stop.wait()
    agent.stop()
    return 0
