"""A device's per-job state store (edge_client/state.py): atomic, bound, bounded, dropped."""

import os

import numpy as np
import pytest

from edge_client.state import TEMP_PREFIX, DeviceStateStore, StateBudgetExceeded
from protocols.payloads.stateful import StateBinding


class Clock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self):
        return self.now


def arrays(seed=0, n=5):
    rng = np.random.default_rng(seed)
    return {"bias": rng.normal(size=n).astype(np.float32), "c.weight": rng.normal(size=(n, 3)).astype(np.float32)}


def test_saved_state_survives_a_new_store_on_the_same_folder(tmp_path):
    a = arrays(1)
    DeviceStateStore(tmp_path).save("job-1", "ab" * 8, 3, a)
    entry = DeviceStateStore(tmp_path).load("job-1", "ab" * 8)       # a restarted agent
    assert entry.round == 3 and entry.job_id == "job-1"
    for k in a:
        np.testing.assert_array_equal(entry.arrays[k], a[k])
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".tmp")] == []


def test_another_run_of_the_same_job_id_drops_the_state(tmp_path):
    store = DeviceStateStore(tmp_path)
    store.save("job", "aa" * 8, 1, arrays())
    assert store.load("job", "bb" * 8) is None
    assert store.load("job", "aa" * 8) is None          # dropped on sight, not kept for later
    assert store.jobs() == []


def test_stale_state_is_not_trusted_but_fresh_state_is(tmp_path):
    store = DeviceStateStore(tmp_path)
    store.save("job", "aa" * 8, 10, arrays())
    assert store.load("job", "aa" * 8, round_=15, max_staleness=5).round == 10
    assert store.load("job", "aa" * 8, round_=16, max_staleness=5) is None


def test_expired_state_is_swept(tmp_path):
    clock = Clock()
    store = DeviceStateStore(tmp_path, clock=clock)
    store.save("old", "aa" * 8, 1, arrays(), ttl_s=10)
    store.save("new", "aa" * 8, 1, arrays(), ttl_s=100)
    clock.now += 50
    assert DeviceStateStore(tmp_path, clock=clock).jobs() == ["new"]


def test_budget_refuses_a_job_that_does_not_fit_and_changes_nothing(tmp_path):
    a = arrays(n=5)
    size = sum(v.nbytes for v in a.values())
    store = DeviceStateStore(tmp_path, budget_bytes=size + size // 2)
    store.save("one", "aa" * 8, 1, a)
    store.save("one", "aa" * 8, 2, a)                    # replacing its own state fits
    with pytest.raises(StateBudgetExceeded, match="budget"):
        store.save("two", "aa" * 8, 1, a)
    assert store.jobs() == ["one"] and store.load("one", "aa" * 8).round == 2


def test_torn_or_foreign_files_read_as_no_state(tmp_path):
    store = DeviceStateStore(tmp_path)
    store.save("job", "aa" * 8, 1, arrays())
    path = next(tmp_path.glob("*.npz"))
    path.write_bytes(path.read_bytes()[:40])             # killed mid-write without the rename
    assert store.load("job", "aa" * 8) is None and not path.exists()
    leftover = tmp_path / (TEMP_PREFIX + "a1b2c3d_")          # a crash's temporary file (mkstemp's name)
    leftover.write_bytes(b"x")
    (tmp_path / (path.name)).write_bytes(b"not an npz")
    assert DeviceStateStore(tmp_path).jobs() == [] and not leftover.exists()


def test_the_store_touches_only_the_files_it_writes(tmp_path):
    """A review's finding: `fedfleet device --state-dir DIR` pointed at a folder that also held the
    operator's files deleted every *.npz it could not read and every .tmp-* at start-up (and
    `--forget-state` the same). The store reads, sweeps and forgets only its own names: a job's
    <32 hex>.npz and its temporary prefix; a torn file of its own is still removed."""
    import numpy as np

    foreign = {"model.npz": b"PK not ours", "eval_features.npz": b"x", ".tmp-notes": b"y",
               "0123456789abcdef0123456789abcdef.npy": b"z", TEMP_PREFIX + "short": b"w"}
    for name, data in foreign.items():
        (tmp_path / name).write_bytes(data)
    np.savez(tmp_path / "weights.npz", w=np.ones(3))           # a readable npz: not state either
    store = DeviceStateStore(tmp_path)
    store.save("job", "aa" * 8, 1, arrays())
    torn = tmp_path / ("f" * 32 + ".npz")
    torn.write_bytes(b"torn")
    assert store.jobs() == ["job"] and not torn.exists()
    assert store.forget() == 1 and store.jobs() == []
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([*foreign, "weights.npz"])
    assert all((tmp_path / name).read_bytes() == data for name, data in foreign.items())


def test_a_job_id_never_becomes_a_path(tmp_path):
    store = DeviceStateStore(tmp_path / "s")
    store.save("../../etc/passwd", "aa" * 8, 1, arrays())
    assert [p.parent for p in (tmp_path / "s").iterdir()] == [tmp_path / "s"]
    assert store.load("../../etc/passwd", "aa" * 8) is not None


def test_drop_and_forget(tmp_path):
    store = DeviceStateStore(tmp_path)
    for job in ("a", "b", "c"):
        store.save(job, "aa" * 8, 1, arrays())
    assert store.drop("a") and not store.drop("a")
    assert store.forget() == 2 and store.jobs() == [] and os.listdir(tmp_path) == []


@pytest.mark.parametrize("bad", [{"run": "XYZ"}, {"run": "ab"}, {"round": -1}, {"round": True},
                                 {"max_staleness": 1.5}, {"ttl_s": 0}, {"ttl_s": float("inf")}, {"extra": 1}])
def test_state_binding_refuses_malformed_params(bad):
    state = {"run": "ab" * 8, "round": 1, **bad}
    with pytest.raises(ValueError):
        StateBinding.from_params(state)


def test_fedfleet_device_forget_state_empties_the_store_and_exits(tmp_path, capsys):
    from fedfleet.cli import main

    store = DeviceStateStore(tmp_path / "state")
    store.save("a", "aa" * 8, 1, arrays())
    store.save("b", "aa" * 8, 1, arrays())
    assert main(["device", "--idx", "x", "y", "--state-dir", str(tmp_path / "state"), "--forget-state"]) == 0
    assert DeviceStateStore(tmp_path / "state").jobs() == []
    assert "2 file(s) removed" in capsys.readouterr().out
