"""Streaming Fed3R on one aggregator with a store (the contribution writer: Fed3R splits its
validation): a device that sends its round-2 increment under the message id of its round-1 result
passed the round machine (seen_ids are per round) and was applied to the live job, then its write
failed on the store's UNIQUE (job_id, message_id): the writer failed the whole batch (other devices'
results too) and the runner rebuilt the job from the store, on every re-send (a review's finding).
The runner refuses it now (rejected: the id of a result the job holds), before it is applied."""
import time

from aggregator.jobs.registry import build_job
from aggregator.security.fleet import Fleet
from aggregator.service.active_job import ActiveJob, ValidatedResult
from aggregator.service.contribution_writer import ContributionWriter
from aggregator.service.crash_points import CrashPoints
from aggregator.service.job_runner import JobRunner, RunnerServices
from aggregator.service.recovery import open_stored
from aggregator.storage.store import Store
from protocols.envelope import decode, encode
from protocols.rounds import ResultArrived

from test_shard_ingest import CONFIG, DEVICES, result


def test_a_message_id_reused_in_a_later_round_is_refused_not_a_store_failure(tmp_path):
    config = {**CONFIG, "streaming": True, "clients_per_round": 1}
    store = Store(tmp_path / "agg.db")
    job = build_job("fed3r", config)
    a = ActiveJob(job, "fed3r", tmp_path / "out")
    a.out_dir.mkdir()
    open_stored(a, store, True, CrashPoints())
    fatal, sent = [], []
    writer = ContributionWriter(store, lambda: None)
    runner = JobRunner(a, RunnerServices(
        fleet=Fleet(store, None, set(DEVICES), False), store=store, crash=CrashPoints(),
        send=lambda d, env: sent.append((d, env)), publish_status=lambda body: None, bytes_sent=lambda: 0,
        on_fatal=lambda reason, stop=False: fatal.append(reason), writer=writer))
    device = DEVICES[0]
    n0 = 4
    for round_, start in ((1, 0), (2, n0)):
        assert a.job.next_participants({device}) == [device]
        runner._open_round([device], time.monotonic())
        assert a.job.round == round_
        env = decode(result(0, from_sample=start, round_=round_))
        env.id = "ab" * 16                           # the same id in both rounds
        raw = encode(env)
        coord = a.rounds[round_]
        runner.handle(coord, ResultArrived(device, env.id, ValidatedResult(a.job.parse_result(env), raw)))
        runner.flush_writes()
    writer.close()
    stored = [c.round for c in store.contributions(a.job_id, with_payload=False)]
    assert not fatal, f"one device's reused message id made the runner rebuild the job: {fatal}"
    assert stored == [1] and a.job.contributed == {device: n0}
    # round 2, closed and let go (closed_rounds.py), refused it, durably and in what it still answers
    assert [(e["device"], e["event"], e["reason"]) for e in store.round_events(a.job_id, 2)] == \
        [(device, "rejected", "the message id of a result this job holds already")]
    assert a.closed.answers == {device: ("rejected", "the message id of a result this job holds already")}
