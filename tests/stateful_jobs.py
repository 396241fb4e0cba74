"""What the stateful head-task tests (pp, scaffold, fedgloss) share: a seeded extractor that
projects pixels (no backbone, so they stay unit tests) and one round driven through the real
task and result encoding."""

import numpy as np

from edge_client.features import FeatureExtractor
from protocols import messages as M
from protocols.envelope import decode, encode
from protocols.rounds import RoundClosed


def pixel_extractor(size: int, dim: int) -> FeatureExtractor:
    proj = np.random.default_rng(99).normal(size=(3 * size * size, dim)).astype(np.float32) / 20
    return FeatureExtractor(lambda x: x.reshape(len(x), -1) @ proj, image_size=size,
                            mean=(0.5, 0.5, 0.5), std=(0.25, 0.25, 0.25), feature_dim=dim)


def run_round(job, handlers, kind: str, only=None, tamper=None, silent=()) -> dict:
    """One round: each chosen device gets its task through encode/decode, its result goes back the
    same way (``tamper(device, tensors)`` may change it on the wire; a ``silent`` device never
    answers). device -> (params, tensors, body, out)."""
    chosen = job.next_participants(set(only or handlers))
    sent = {}
    for d in (d for d in chosen if d not in silent):
        params, tensors = job.task_for(d)
        task = decode(encode(M.task_message("aggregator", job.config.job_id, job.round, kind, params, 1e9)))
        body, out = handlers[d](task.body["params"], tensors)
        if tamper:
            out = tamper(d, out)
        env = decode(encode(M.result_message(d, M.TaskRef(job.config.job_id, job.round, task.id), kind, body, out)))
        job.apply(d, job.parse_result(env))
        sent[d] = (task.body["params"], tensors, body, out)
    job.close_round(RoundClosed(job.round, tuple(sent), tuple(d for d in chosen if d in silent), (), ()))
    return sent


def minibatches(n: int, batch_size: int, epochs: int, seed: int):
    """The head trainers' batch order (numpy reference): a fresh permutation per epoch, cut in order."""
    rng = np.random.default_rng(seed)
    for _ in range(epochs):
        order = rng.permutation(n)
        for s in range(0, n, batch_size):
            yield order[s:s + batch_size]


def ce_grads(x: dict, Z: np.ndarray, y: np.ndarray, rows: np.ndarray, temperature: float) -> dict:
    """float64 gradients of the mean T-scaled cross-entropy over ``rows`` at head ``x`` (weight, bias)."""
    logits = (Z[rows] @ x["weight"].T + x["bias"]) / temperature
    p = np.exp(logits - logits.max(axis=1, keepdims=True))
    p /= p.sum(axis=1, keepdims=True)
    p[np.arange(len(rows)), y[rows]] -= 1.0
    g = p / (temperature * len(rows))
    return {"weight": g.T @ Z[rows], "bias": g.sum(axis=0)}


def oll_after(job, handler, extractor) -> tuple:
    """OLL on ``handler``'s device after the stateful ``job`` (its model, ``personal_job`` = the job):
    (the report's body, the arrays the job left in the device's store, the OLL task, the OLL job)."""
    from aggregator.jobs.personalize import PersonalizeConfig, PersonalizeJob
    from edge_client.tasks.personalization import PersonalizeTask

    c = job.config
    oll = PersonalizeJob(PersonalizeConfig(num_classes=c.num_classes, feature_dim=c.feature_dim,
                                           image_size=c.image_size, fp_epochs=0, personal_job=c.job_id),
                         head=job.model_arrays())
    task = PersonalizeTask(handler.images, handler.labels, handler.holdout_images, handler.holdout_labels,
                           lambda *a, **k: extractor, state=handler.store)
    body, _ = task(*oll.task_for("dev0"))
    return body, handler.store.load(c.job_id, None).arrays, task, oll


def run_secure_round(job, clients: dict, now: float = 0.0, intercept=None) -> tuple[str, ...]:
    """One secure round in process, the real SecAgg client and server: the job samples, each chosen
    device's SecAgg wrapper (``clients[device]``, a ``SecureUpdate``) takes its task through the
    wire codec (a decline is a device that never joins), the secagg envelopes go back and forth
    until the group settles (a silent phase is timed out), and the round closes with the survivors.
    ``intercept(device, envelope)`` sees every envelope a device sends. The survivors."""
    from edge_client.agent import TaskDeclined

    chosen = job.next_participants(set(clients))
    declined = []
    for d in chosen:
        params, tensors = job.task_for(d)
        task = decode(encode(M.task_message("aggregator", job.config.job_id, job.round, job.kind, params, 1e9)))
        try:
            clients[d].on_task(job.config.job_id, job.round, task.body["params"], tensors)
        except TaskDeclined:
            declined.append(d)
    pending = job.on_protocol_tick(now)
    while job.secure_round_live(job.round):
        if not pending:             # every answer is in: what is missing times out
            now += job.config.phase_timeout_s + 1
            pending = job.on_protocol_tick(now)
            continue
        sends, pending = pending, []
        for device, env in sends:
            for reply in clients[device].on_message(decode(encode(env))):
                if intercept:
                    intercept(device, reply)
                pending += job.on_protocol(device, decode(encode(reply)), now)
    survivors = job.settled(job.round) or ()
    dropped = tuple(d for d in chosen if d not in survivors and d not in declined)
    job.close_round(RoundClosed(job.round, tuple(survivors), dropped, tuple(declined), ()))
    return tuple(survivors)
