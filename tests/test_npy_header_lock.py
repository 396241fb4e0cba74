"""numpy parses every .npy header with ``ast.literal_eval``, and CPython 3.11's AST construction is
not thread-safe (python/cpython#106905): two threads parsing at once can raise "SystemError: AST
constructor recursion depth mismatch". The suite saw it refuse a good head on an emulated host
whose device threads loaded arrays together. The device's readers that run in threads of their
own (a rollout's head, the state store, the feature cache) parse under ``NPY_HEADER_LOCK``: checked
here by recording, at every header parse, whether the lock is held (the interpreter's race itself
needs a thread switch inside the AST constructor, which no test can force)."""

import ast
import hashlib

import numpy as np
import pytest

from edge_client.features import FeatureExtractor
from edge_client.state import DeviceStateStore
from protocols.files import NPY_HEADER_LOCK
from protocols.payloads.deployment import head_from_npz, head_npz


@pytest.fixture
def parses(monkeypatch):
    held: list[bool] = []
    literal_eval = ast.literal_eval

    def recording(text):
        held.append(NPY_HEADER_LOCK.locked())
        return literal_eval(text)

    monkeypatch.setattr(ast, "literal_eval", recording)
    return held


def test_a_rollouts_head_is_parsed_under_the_lock(parses):
    data = head_npz(np.ones((3, 4), np.float32), np.zeros(3, np.float32))
    W, b = head_from_npz(data, hashlib.sha256(data).hexdigest())
    # the two members' headers, each once (protocols/canonical_npz.py reads the members itself)
    assert W.shape == (3, 4) and parses == [True] * 2


def test_the_state_store_parses_under_the_lock(parses, tmp_path):
    store = DeviceStateStore(tmp_path)
    store.save("job", "run1", 1, {"v": np.arange(3, dtype=np.float32)})
    parses.clear()
    assert store.load("job", "run1").arrays["v"].tolist() == [0, 1, 2]
    assert parses and all(parses)


def test_the_aggregators_models_and_checkpoints_are_read_under_the_lock(parses, tmp_path):
    """The rollout controller's thread reads stored models while the service thread reads its
    checkpoints and the API's threads build jobs from model files: all through read_npz."""
    from aggregator.storage.rounds import _write_checkpoint
    from aggregator.storage.store import Store

    store = Store(tmp_path / "s.db")
    store.create_job("job", "fedavg", {"num_classes": 2})
    with store._tx() as db:
        _write_checkpoint(db, "job", 1, {"w": np.ones(3)}, {})
    parses.clear()
    _, state, _ = store.checkpoint("job")
    assert state["w"].tolist() == [1, 1, 1] and parses == [True]       # one header, parsed once


def test_the_feature_cache_is_read_under_the_lock(parses, tmp_path):
    path = tmp_path / "features.npy"
    extractor = FeatureExtractor.__new__(FeatureExtractor)      # only the cache reader: no network built
    extractor._store(path, np.ones((2, 5), np.float32))         # with its checksum, as the cache writes it
    extractor._feature_dim = 5
    assert extractor._load_cached(path, 2).shape == (2, 5) and parses == [True]
