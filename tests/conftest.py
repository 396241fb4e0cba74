import collections
import functools
import itertools
import os
import re
import sys

import pytest

# Helper modules whose asserts compare what tests compare: rewritten as the test modules are, so a
# failure shows both sides (registered before any test module imports them).
pytest.register_assert_rewrite("secagg_rounds", "secure_shard_runs", "java_tasks")

from ray_cluster import SharedCluster
from shared_build import build_once, run_folder

pytest_plugins = ("cpu_profile",)

from aggregator.compute import privacy

# dp-accounting (absl) is imported lazily by the aggregator, the first time a privacy budget is
# computed, so that processes without DP do not pay for it. In the test processes it is imported
# here, at collection, as before: imported inside a test, absl's logging set-up would meet that
# test's capture streams.
privacy._accounting()


# The fast tier (`make test-fast`, the edit loop) is every test not marked ``integration``. A test
# is integration when it brings up something that takes seconds to start — a broker, an exported
# bundle, another process, a JVM, a Ray cluster, a browser: it asks for one of these fixtures, is
# marked ``slow``, or its file starts one itself (found in its source, so a new file needs no list).
INTEGRATION_FIXTURES = frozenset({"broker", "mobilenet_bundle_32px", "tail_bundle", "onnx_bundle_32px",
                                  "ray_test_cluster"})
STARTS_SOMETHING = re.compile(r"subprocess\.|MosquittoBroker\(|java_build|two_node_ray_cluster|second_broker|"
                              r"export_bundle\(|chromium|EmulatedFleet|serve_until_done|from export.cli import|"
                              # tests/secure_shard_runs.py's: a broker and one aggregator's and two shards' runs
                              r"run_secure\(|one_and_sharded\(|check_secure_rounds\(")
# Tests in otherwise fast files that export a program, train on a real backbone or spawn workers
# (file::test, every parametrisation; "[prefix" narrows to those whose parameters start so).
INTEGRATION_TESTS = (
    "test_backbones.py::test_pretrained_features_beat_random_init_on_fashion_mnist",
    "test_backbones.py::test_exports_with_dynamic_batch_and_matches_eager",
    "test_ladd_losses.py::test_executorch_training_program_matches_eager",
    "test_ladd_losses.py::test_model_exports_for_inference",
    "test_fed3r_factor.py::test_on_mobilenet_features_devices_send_the_factor_and_the_model_equals_the_dense_one",
    "test_mask_expansion.py::test_process_applier_is_bit_identical_to_apply_masks",
    "test_secagg_protocol.py::test_secagg_plus_survives_the_declared_dropout_rate",
    "test_fleet_presets.py::test_fleet_100k_assignment_is_long_tailed_and_repeats_images",
    "test_data_readers.py::test_fashion_mnist_splits",
    "test_job_contract.py::test_every_kind_builds_a_job_that_keeps_the_contract[fedavg-tail",   # the tail bundle
    "test_job_contract.py::test_every_kind_builds_a_job_that_keeps_the_contract[scaffold-tail",  # the tail bundle
    "test_runtime_fed3r_parity.py::test_a_missing_bundle_is_exported_once_then_reused",          # an (eager) export
)


# Parameter sets that `make test` leaves to `make test-full` (FEDFLEET_ALL_VARIANTS=1), for the suite's
# time on CI's two cores: each is a variant of a test another parameter set of which runs in make
# test, and whose own parts other tests hold: the EfficientNet-Lite0 export beside MobileNetV2's (its
# eager and ONNX programs in test_backbones.py); crash-resuming a plain tail job beside the secure tail
# job (a mid-round replay of stored contributions: plain FedAvg's in test_crash_recovery.py); Scaffold
# with a tail on shards beside FedAvg with a tail and Scaffold without; the secure tail kind on shards
# beside the other secure kinds (the tail's sums: fedavg-tail on shards); central DP through
# `simulate` beside secure DP (its release at the end: test_dp_release_at_end.py, its center:
# test_dp_fed3r_center.py). Only parameter sets are listed, never a whole test: a collection that holds a
# listed test's every parameter set must run one of them here, and an entry that names nothing
# collected is stale; both are collection errors (``_check_variants``).
# "file::test[params]" names one set; "file::test[prefix" those whose parameters start so.
VARIANTS = (
    "test_export_bundle.py::test_artifact_matches_eager_on_real_images[efficientnet_lite0",
    "test_export_bundle.py::test_manifest_describes_every_file[efficientnet_lite0",
    "test_crash_resume_kinds.py::test_job_created_through_the_api_resumes_after_sigkills_to_the_uninterrupted_model[fedavg-tail]",
    "test_shard_rounds.py::test_fedavg_rounds_on_two_shards_give_one_aggregators_model_bit_for_bit[scaffold-tail]",
    "test_secure_shards_parity.py::test_secure_fedavg_kinds_on_two_shards_give_one_aggregators_model_bit_for_bit[fedavg-tail-secure]",
    "test_simulation_e2e.py::test_simulate_dp_epsilon_runs_dp_fed3r_with_a_private_center_on_the_devices[central]",
)
ALL_VARIANTS = os.environ.get("FEDFLEET_ALL_VARIANTS") == "1"


def _names(item) -> str:
    return f"{item.path.name}::{item.name}"


def _matches(name: str, entry: str) -> bool:
    return name == entry if entry.endswith("]") else name.startswith(entry)


def _listed(item) -> bool:
    name = _names(item)
    return any(name.startswith(t if "[" in t else t + "[") or name == t for t in INTEGRATION_TESTS)


def _variant(item) -> bool:
    return any(_matches(_names(item), entry) for entry in VARIANTS)


def _check_variants(config, items) -> None:
    """VARIANTS' rules, on a collection of the whole suite (a -k, -m or a file given may select a
    variant alone): every entry names a parameter set collected, and every listed test keeps one
    parameter set that is no variant."""
    assert all("[" in entry for entry in VARIANTS), "VARIANTS lists parameter sets, never a whole test"
    if config.args != [str(config.rootpath / "tests")] and config.args not in ([], ["tests"]) \
            or config.option.keyword or config.option.markexpr:
        return
    for entry in VARIANTS:
        matched = [item for item in items if _matches(_names(item), entry)]
        if not matched:
            raise pytest.UsageError(f"tests/conftest.py VARIANTS: {entry!r} names no collected test")
        function = {(item.path, item.originalname) for item in matched}
        if all(_variant(item) for item in items if (item.path, item.originalname) in function):
            raise pytest.UsageError(f"tests/conftest.py VARIANTS: {entry!r} leaves no parameter set of its "
                                    "test to make test")


@functools.cache
def _file_starts_something(path) -> bool:
    return bool(STARTS_SOMETHING.search(path.read_text()))


def pytest_collection_modifyitems(config, items):
    for item in items:
        if (INTEGRATION_FIXTURES.intersection(item.fixturenames) or item.get_closest_marker("slow")
                or _file_starts_something(item.path) or _listed(item)):
            item.add_marker(pytest.mark.integration)
    _check_variants(config, items)
    if not ALL_VARIANTS:
        for item in filter(_variant, items):
            item.add_marker(pytest.mark.skip(reason="make test-full runs it (tests/conftest.py VARIANTS)"))
    _slow_files_first(items)


def _slow_files_first(items):
    """Under pytest-xdist (`make test` runs `-n N --dist loadfile`), the files holding tests
    marked ``slow`` are collected first, the most slow tests first, so the workers start on them
    and the short files fill in around them; a long file handed out last would run alone at the
    end. Only the order changes, and only in xdist workers (a plain run keeps the files' order):
    the stable sort keeps every file's tests together and in their own order."""
    if not os.environ.get("PYTEST_XDIST_WORKER"):
        return
    slow_tests = collections.Counter(item.path for item in items if item.get_closest_marker("slow"))
    files: dict = {}
    for item in items:
        files.setdefault(item.path, len(files))
    # Within a file, the tests on the shared Ray test cluster (``ray_cluster``) go last: the
    # cluster then lives only while they run (and the next RAY_CLUSTER_FILES' file's), not while
    # the file's other tests do.
    items.sort(key=lambda item: (-slow_tests[item.path], files[item.path],
                                 item.get_closest_marker("ray_cluster") is not None))


# The machine's one shared Ray test cluster (tests/ray_cluster.py): the files whose tests use it
# (marked ``ray_cluster``) run on one xdist worker, one after the other, and that worker starts one
# cluster for them all (each file starting its own cost a cluster's start and stop, and a worker
# idle at the cluster lock while another file's cluster ran).
RAY_CLUSTER_FILES = frozenset({"test_shards.py", "test_fleet_ray.py", "test_secure_shards_ray.py"})
_RAY = SharedCluster()


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """Under ``--dist loadfile``: each file is a unit of work, as before, but the RAY_CLUSTER_FILES
    are one unit (a worker runs them back to back, in collection order)."""
    if config.getoption("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadFileScheduling

    class RayFilesTogether(LoadFileScheduling):
        def _split_scope(self, nodeid):
            scope = super()._split_scope(nodeid)
            return "ray-cluster-files" if scope.rpartition("/")[2] in RAY_CLUSTER_FILES else scope

    return RayFilesTogether(config, log)


@pytest.fixture
def ray_test_cluster():
    """The shared two-node Ray test cluster's head address (tests marked ``ray_cluster`` only)."""
    return _RAY.get()


@pytest.hookimpl(trylast=True)
def pytest_runtest_teardown(item, nextitem):
    """The cluster stops once the tests go on to a file that does not use it (after the test's own
    fixtures are torn down), not at the session's end: the worker runs other files without it."""
    if nextitem is None or nextitem.path.name not in RAY_CLUSTER_FILES:
        _RAY.close()


def pytest_sessionfinish(session):
    _RAY.close()        # an interrupted session too


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


@pytest.fixture(autouse=True)
def _device_state_home(tmp_path_factory, monkeypatch):
    """``fedfleet device`` keeps its state under $FEDFLEET_STATE_HOME by default: each test's own
    folder (made only when a device writes there), never the real home; subprocesses inherit it."""
    monkeypatch.setenv("FEDFLEET_STATE_HOME", str(tmp_path_factory.getbasetemp() / "device-state" /
                                                 f"{os.getpid()}-{next(_STATE_HOMES)}"))


_STATE_HOMES = itertools.count()


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
    under load); tests measure correctness, not speed. The BLAS and OpenMP pools too (threadpoolctl):
    their idle threads spin, and under the suite's load that spinning was seen taking ~40 CPU-s."""
    try:
        import torch
    except ImportError:
        yield
        return
    from threadpoolctl import threadpool_limits

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    with threadpool_limits(1):
        yield
    torch.set_num_threads(before)


@pytest.fixture(autouse=True)
def _still_one_torch_thread(_one_torch_thread):
    """Code under test may set the process's thread counts (``fedfleet simulate``'s extractor did,
    a device's ``--threads`` does): one again before each test, not for the rest of the worker's
    files; the BLAS pools of libraries loaded since (scipy's) too (threadpoolctl, ~1 ms)."""
    torch = sys.modules.get("torch")
    if torch is not None and torch.get_num_threads() != 1:
        torch.set_num_threads(1)
    if torch is not None:
        from threadpoolctl import threadpool_limits

        threadpool_limits(1)
    yield


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
