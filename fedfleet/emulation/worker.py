"""A worker process hosting many emulated devices, each a real edge_client DeviceAgent.

Devices of one worker share the process (and its copy of the dataset and backbone weights, as
several apps on one phone would share a system library) but never the aggregator's memory: the
aggregator is another process, reached only through the broker. Each device has its own MQTT
connection, session state, data shard and profile, hosted by a :class:`~.host.DeviceHost` (one
MQTT event loop, no thread per device). One compute slot per worker makes devices of the worker
take turns on the CPU, so a 2-core machine is not oversubscribed; profile slowdowns are slept
*outside* the slot, as a slow phone would not slow down other phones. A device's data and task
handlers exist only while it runs a task (:class:`~.host.LazyTasks`). Classification devices
hold a shard of a labelled dataset (``dataset``, ``shards_file``); LADD devices their own
unlabelled images (``ladd_devices_file``: an .npz of device id -> images) and share one
segmentation network per worker.

Run as ``python -m fedfleet.emulation.worker SPEC.json``; stops on SIGTERM/SIGINT.
"""

from __future__ import annotations

import json
import logging
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Callable

import numpy as np

from edge_client.agent import AgentHooks, DeviceAgent, DroppedOut
from edge_client.data import load_fashion_mnist
from edge_client.handlers import (HandlerConfig, LocalData, SharedExtractors, device_handlers, ladd_handlers,
                                  secure_handlers)
from edge_client.state import DeviceStateStore
from edge_client.work_deadline import sleep_within
from protocols.identity import DeviceIdentity
from protocols.log_text import log_to_stderr
from protocols.mqtt_link import BrokerConfig
from protocols.topics import Topics

from ..bundles import make_extractor
from ..quiet import quiet_third_party_warnings
from .broker import broker_for
from .host import DeviceHost, LazyTasks, rss_mb
from .profiles import DeviceProfile

log = logging.getLogger("fedfleet.worker")


def profile_hooks(profile: DeviceProfile, t0: float, rng: np.random.Generator,
                  slot_wait_s: Callable[[], float] = lambda: 0.0) -> AgentHooks:
    """``slot_wait_s``: how long the task just run waited for its host's compute slot. That wait
    is the host's, not the device's (``AgentHooks.queued_s``): a slower device takes longer for
    its own compute only (stretching the wait too would make a device that queued behind all of
    its host's others sleep for minutes when a round asks every device at once), and the
    device's compute time in the statistics leaves it out."""
    def after_compute(elapsed: float) -> None:
        sleep_within(profile.extra_compute_delay(elapsed))     # a slower device: stopped with its round too
        if profile.draws_dropout(rng):
            raise DroppedOut()

    return AgentHooks(after_compute=after_compute,
                      before_upload=lambda n: time.sleep(profile.upload_delay(n)),
                      is_available=lambda: profile.is_available(time.monotonic() - t0), queued_s=slot_wait_s,
                      always_available=not profile.availability,
                      info={"emulated": True, "slowdown": profile.compute_slowdown,
                            "upload_bytes_per_s": profile.upload_bytes_per_s})


def load_dataset(name: str, root: str | None):
    if name == "fashion-mnist":
        # read once and held for the host's life: a kept copy (load_fashion_mnist's keep) would double its memory
        return load_fashion_mnist("train", Path(root) if root else None, keep=False)
    raise ValueError(f"unknown dataset {name!r}")


def _lazy_device_tasks(images, labels, train_idx, holdout_idx, extractors, spec, host: DeviceHost,
                       state_dir: Path | None = None) -> LazyTasks:
    """The device's handlers, built per task from the host's shared dataset (see LazyTasks); its
    per-job state lives in ``state_dir`` (on disk: it outlives the task and the worker process)."""
    def build() -> dict:
        return device_handlers(LocalData(images, labels, train_idx, holdout_idx), extractors,
                               HandlerConfig(spec.get("training_manifest"), spec.get("tail_manifest")),
                               state=DeviceStateStore(state_dir) if state_dir is not None else None)

    kinds = build().keys()          # built once to learn the kinds it offers, then dropped
    return LazyTasks(build, kinds, host.compute_slot)


def _extractor_factory(spec: dict):
    """Emulated devices export their bundle locally (fedfleet.bundles) for the spec's runtime."""
    cache_dir, runtime, threads = spec.get("cache_dir"), spec.get("runtime", "eager"), spec.get("threads", 1)
    return lambda backbone, image_size: make_extractor(backbone, image_size, cache_dir, runtime, threads)


def _ladd_handlers(spec: dict, host: DeviceHost):
    """device id -> its handlers: LADD style and self-training on the device's own images. They
    live as long as the device (a device keeps its KD model between rounds, and the secure
    variant needs the training task itself); one segmentation network per worker, shared under
    a lock, as several apps on a phone would share a library."""
    from edge_client.models import weights_sha256
    from edge_client.models.segmentation import SegmentationModel

    images = np.load(spec["ladd_devices_file"])
    lock, models = threading.Lock(), {}

    def model_for(seg_spec):
        if seg_spec not in models:
            models[seg_spec] = SegmentationModel(seg_spec)
        return models[seg_spec]

    return lambda device_id: ladd_handlers(images[device_id], model_for, lock, lambda: weights_sha256("mobilenet_v2"),
                                           spec.get("runtime", "eager"))


def _classification_handlers(spec: dict, host: DeviceHost):
    """device id -> its LazyTasks: handlers on its shard of the labelled dataset (Fed3R, FedAvg,
    FT, OLL), built per task."""
    images, labels = load_dataset(spec["dataset"], spec.get("data_root"))
    shards = _indices(spec, "shards")
    holdouts = _indices(spec, "holdout") if spec.get("holdout_file") or spec.get("holdout") else None
    extractors = SharedExtractors(_extractor_factory(spec), spec.get("cache_dir"))
    state_root = Path(spec["state_dir"]) if spec.get("state_dir") else None
    return lambda device_id: _lazy_device_tasks(images, labels, shards[device_id],
                                                holdouts[device_id] if holdouts is not None else None,
                                                extractors, spec, host,
                                                state_root / device_id if state_root is not None else None)


def start_devices(spec: dict, host: DeviceHost) -> list[DeviceAgent]:
    """Every device of the spec as a DeviceAgent on ``host``; idle devices keep only their ids,
    profile and data (indices) (task state is built per task)."""
    handlers_of = (_ladd_handlers if spec.get("ladd_devices_file") else _classification_handlers)(spec, host)
    # devices dealt over the edge brokers of a broker tree (fedfleet.emulation.broker.BrokerTree)
    broker_urls = spec.get("device_brokers") or [spec["broker"]]
    # a fleet's keepalive: every device pings once per keepalive, and a host's one loop answers them all
    brokers = {url: BrokerConfig.from_url(url, keepalive=spec.get("keepalive_s", 30)) for url in broker_urls}
    topics = Topics(spec.get("topic_root", "fedfleet"))
    t0 = time.monotonic()
    secure = spec.get("secure")
    for dev in spec["devices"]:
        profile = DeviceProfile.from_dict(dev["profile"])
        device_id = profile.device_id
        tasks = handlers_of(device_id)        # LazyTasks (classification) or the handlers themselves (LADD)
        handlers = tasks.handlers() if isinstance(tasks, LazyTasks) else tasks
        slot_wait_s = (lambda tasks=tasks: tasks.slot_wait_s) if isinstance(tasks, LazyTasks) else (lambda: 0.0)
        rng = np.random.default_rng([spec.get("seed", 0), int(dev["index"])])
        protocol_handlers = {}
        if secure:
            identity = DeviceIdentity.from_private_bytes(device_id, bytes.fromhex(secure["device_keys"][device_id]))
            protocol_handlers = secure_handlers(identity, bytes.fromhex(secure["aggregator_public_key"]), handlers)
        broker = brokers[broker_for(int(dev["index"]), broker_urls)]
        host.add(lambda link_factory, device_id=device_id, profile=profile, handlers=handlers, rng=rng,
                 protocol_handlers=protocol_handlers, slot_wait_s=slot_wait_s, broker=broker: DeviceAgent(
                     device_id, broker, handlers, topics, hooks=profile_hooks(profile, t0, rng, slot_wait_s),
                     retry_after_s=spec.get("retry_after_s", 10.0), protocol_handlers=protocol_handlers,
                     link_factory=link_factory))
    return list(host.agents.values())


def _indices(spec: dict, name: str) -> dict[str, np.ndarray]:
    """Each of the spec's devices' data indices: inline (``spec[name]``, a Ray actor on another
    machine) or from the run's .npz file (``spec[name + "_file"]``, local workers)."""
    ids = [d["profile"]["device_id"] for d in spec["devices"]]
    if spec.get(name) is not None:
        return {d: np.asarray(spec[name][d], dtype=np.int64) for d in ids}
    with np.load(spec[f"{name}_file"]) as f:
        return {d: f[d] for d in ids}


def host_devices(spec: dict) -> tuple[DeviceHost, list[DeviceAgent]]:
    """A started host with the spec's devices (local worker process or Ray actor)."""
    host = DeviceHost(step_threads=spec.get("step_threads", 8), compute_slots=spec.get("compute_slots", 1),
                      source_addresses=spec.get("source_addresses") or ())
    if spec.get("training_manifest"):
        threading.Thread(target=warm_up_training, args=(spec["training_manifest"],), name="training-warm-up",
                         daemon=True).start()
    return host, start_devices(spec, host)


def warm_up_training(manifest: str) -> None:
    """Load the head's training program once, in the background, so that the host's first FedAvg
    task does not wait for the training runtime's import (ExecuTorch's training extension imports
    its export toolchain: seconds of CPU, which the one-shot phases before FedAvg leave idle). A
    failure is left for the tasks themselves to report."""
    from edge_client.runtime import TrainingSession

    try:
        TrainingSession.load(manifest)
    except Exception as exc:
        log.info("training runtime warm-up: %s", exc)


def device_totals(host: DeviceHost, agents: list[DeviceAgent]) -> dict:
    """The host's devices' statistics (what the simulation report sums)."""
    return {"bytes_up": sum(a.stats.bytes_up for a in agents),
              "compute_s": sum(a.stats.compute_s for a in agents),
              "tasks_done": sum(a.stats.tasks_done for a in agents),
              "dropouts": sum(a.stats.dropouts for a in agents),
              "tasks_stopped": sum(a.stats.tasks_stopped for a in agents),
              "devices": len(agents), "rss_mb": rss_mb(), "step_errors": host.step_errors,
              "not_connected": host.connect_problems(),
              "loop_lag_max_s": host.loop.max_lag_s,
              "connections_lost": sum(a.link.connections_lost for a in agents),
              "per_device": {a.device_id: {"bytes_up": a.stats.bytes_up, "bytes_down": a.link.bytes_received,
                                           "compute_s": a.stats.compute_s,
                                           "tasks_done": a.stats.tasks_done, "dropouts": a.stats.dropouts,
                                           "by_kind": a.stats.by_kind}
                             for a in agents}}


def stop_devices(host: DeviceHost, agents: list[DeviceAgent]) -> dict:
    """Stop the host; its devices' statistics."""
    totals = device_totals(host, agents)
    host.stop()
    return totals


def run(spec: dict) -> None:
    host, agents = host_devices(spec)
    started: dict = {}          # devices started per second: how long until all were connected
    threading.Thread(target=lambda: started.update(connect_s=host.seconds_to_connect_all()), name="start-timer",
                     daemon=True).start()
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    stop.wait()
    if spec.get("stats_file"):     # written first: stopping thousands of devices takes a while
        Path(spec["stats_file"]).write_text(json.dumps({**device_totals(host, agents), **started}))
    host.stop()


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    log_to_stderr()
    quiet_third_party_warnings()
    run(json.loads(Path(argv[0]).read_text()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
