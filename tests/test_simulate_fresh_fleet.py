"""``fedfleet simulate`` starts a fresh fleet each run: the device stores an earlier run left in the
same ``--out`` (its devices' kept job state and Fed3R sample windows, ``<out>/device_state``)
describe another fleet's data. Inherited, a device whose new share of the data ends within 8
samples of an old window's end declined Fed3R (edge_client/sample_windows.py), and a stateful
job of the same id read another run's state."""

import dataclasses
import json

from edge_client.sample_windows import WINDOWS_FILE, SampleWindowLedger
from fedfleet.sim_config import PRESETS
from fedfleet.simulate import DEVICE_STATE, prepare

SMALL = dataclasses.replace(PRESETS["smoke"], train_limit=400, test_limit=50)


def test_a_run_into_an_earlier_runs_out_starts_its_devices_without_the_old_stores(tmp_path):
    out = tmp_path / "run"
    old_store = out / DEVICE_STATE / "dev00"
    old_store.mkdir(parents=True)
    (old_store / WINDOWS_FILE).write_text(json.dumps({"boundaries": [0, 25]}))
    (old_store / "jobs").mkdir()
    kept = out / "1-fed3r" / "results.json"          # the run's own reports are not the devices' stores
    kept.parent.mkdir()
    kept.write_text("{}")

    prepare(dataclasses.replace(SMALL, out_dir=str(out)), say=lambda *_: None)

    assert not (out / DEVICE_STATE).exists() or not any((out / DEVICE_STATE).iterdir())
    assert kept.read_text() == "{}"


def test_what_an_inherited_ledger_did_to_a_new_fleets_device(tmp_path):
    """Why: the old run's device answered [0, 25); this run's device of the same id holds 30 samples."""
    (tmp_path / WINDOWS_FILE).write_text(json.dumps({"boundaries": [0, 25]}))
    assert "5 sample(s) from the boundary 25" in SampleWindowLedger(tmp_path / WINDOWS_FILE).refusal(0, 30, 30)
