import collections
import os

import pytest

from shared_build import build_once, run_folder

from aggregator.compute import privacy

# dp-accounting (absl) is imported lazily by the aggregator, the first time a privacy budget is
# computed, so that processes without DP do not pay for it. In the test processes it is imported
# here, at collection, as before: imported inside a test, absl's logging set-up would meet that
# test's capture streams.
privacy._accounting()


def pytest_collection_modifyitems(config, items):
    """Under pytest-xdist (`make test` runs `-n N --dist loadfile`), the files holding tests
    marked ``slow`` are collected first, the most slow tests first, so the workers start on them
    and the short files fill in around them; a long file handed out last would run alone at the
    end. Only the order changes, and only in xdist workers (a plain run keeps the files' order):
    the stable sort keeps every file's tests together and in their own order."""
    if not os.environ.get("PYTEST_XDIST_WORKER"):
        return
    slow_tests = collections.Counter(item.path for item in items if item.get_closest_marker("slow"))
    items.sort(key=lambda item: -slow_tests[item.path])


@pytest.fixture
def broker():
    """A real mosquitto on a free loopback port."""
    from fedfleet.emulation.broker import MosquittoBroker, find_mosquitto

    try:
        find_mosquitto()
    except FileNotFoundError as exc:  # make test installs it; say so loudly if it is missing
        pytest.fail(str(exc))
    with MosquittoBroker() as b:
        yield b


@pytest.fixture(scope="session")
def tail_bundle(mobilenet_bundle_32px):
    """A 32 px MobileNetV2 bundle (its manifest path) whose last stage (1x1 conv 320->1280) is
    trainable: the trunk, the tail's training programs (ExecuTorch and eager) and the aggregator's
    tail_eval. The every-runtime bundle below holds exactly these (same export settings), so the
    suite exports one bundle, not two; its inference programs are simply not used here."""
    return mobilenet_bundle_32px / "manifest.json"


@pytest.fixture(autouse=True, scope="session")
def _one_torch_thread():
    """Intra-op threads oversubscribe a shared 2-core CI box (2 threads can be 10x slower than 1
    under load); tests measure correctness, not speed."""
    try:
        import torch
    except ImportError:
        yield
        return
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def mobilenet_bundle_32px(tmp_path_factory):
    """One small MobileNetV2 bundle (32 px, 10 classes) shared by the tests that need every runtime:
    inference in ExecuTorch, ONNX Runtime and eager torch (with the eager fp32 reference outputs the
    exporter records), the head's training program, and the FT(φ) programs of the last stage (trunk,
    tail training, the aggregator's tail_eval). Returns the bundle's directory; exported once per
    run, shared by the xdist workers."""
    from export import export_bundle
    from export.parity import load_parity_images

    folder = build_once(run_folder(tmp_path_factory) / "mobilenet-32px", lambda d: export_bundle(
        "mobilenet_v2", d / "bundle", num_classes=10, image_size=32, batch_size=8, tail_stages=1,
        inference_runtimes=("executorch", "onnxruntime", "eager"), parity_images=load_parity_images(count=16)))
    return folder / "bundle"


@pytest.fixture(scope="session")
def onnx_bundle_32px(tmp_path_factory):
    """The bundle a torch-free device runs: MobileNetV2 at 32 px, 10 classes, ONNX Runtime
    inference only, no training programs. Exported once per run and shared by the xdist workers:
    read it, never write into it (a test that tampers with a file copies the bundle first)."""
    from export import export_bundle

    folder = build_once(run_folder(tmp_path_factory) / "mobilenet-32px-onnx", lambda d: export_bundle(
        "mobilenet_v2", d / "bundle", num_classes=10, image_size=32, inference_runtimes=("onnxruntime",),
        training=False))
    return folder / "bundle"
