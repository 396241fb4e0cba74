"""Personalization on shards (aggregator/shards/report_receipts.py): nothing to sum, each device's
held-out report carried in its shard's receipt to the coordinator's job. Over a real mosquitto
with the real device handlers (OLL and FP(ψ) on synthetic features), the sharded job, its
coordinator SIGKILLed as a round closes and restarted, keeps one aggregator's reports and reports
its summary (each method's WMA, the FP rates chosen); each shard stores its own devices' reports."""

import json

from aggregator.shards.buckets import shard_of
from fedfleet.emulation.broker import MosquittoBroker

from ops_fleet import Fleet, run_aggregator, write_job
from shard_runs import shard_rows
from test_crash_resume_kinds import personalize


def test_personalization_on_two_shards_keeps_one_aggregators_reports_after_the_coordinator_is_sigkilled(tmp_path):
    import dataclasses

    from fedfleet.sim_config import PRESETS


    from fedfleet.simulate import aggregator_shards

    runs = []
    for name, options, crashes in (("one", [], ()), ("sharded", ["--shards", "2"], ("round_closing",))):
        work, logs = tmp_path / name, ""
        work.mkdir()
        case = personalize(work)
        # what `fedfleet simulate --shards 2` gives the pipeline's personalization job
        assert aggregator_shards(dataclasses.replace(PRESETS["smoke"], shards=2), "personalize",
                                 case.config) == (["--shards", "2"], "")
        write_job(work, case.devices, "personalize", case.config)
        with MosquittoBroker() as broker, Fleet(broker.url, case.devices, handlers=case.handlers):
            for crash in (*crashes, None):
                rc, log = run_aggregator(work, broker.url, work / "state.db", crash=crash, extra=options, timeout=240)
                logs += log
                assert rc == (-9 if crash else 0), log[-3000:]
        assert "rejected message" not in logs
        runs.append(json.loads((work / "out" / "results.json").read_text()))
    one, sharded = runs
    assert sorted(one["contributed"]) == case.devices and sharded["contributed"] == one["contributed"]
    volatile = {"t", "bytes_in", "bytes_out"}
    final = {k: v for k, v in one["final"].items() if k not in volatile}
    assert {k: v for k, v in sharded["final"].items() if k not in volatile} == final
    assert set(final["wma"]) == {"global", "oll", "oll_fp"} and final["test_samples"] > 0
    rows = shard_rows(tmp_path / "sharded" / "state.db", 2)
    assert sorted(d for shard in rows for d, _ in shard) == case.devices      # each report stored once
    assert all(shard_of(d, 2) == k for k, shard in enumerate(rows) for d, _ in shard)
