"""Server steps of whole jobs against float64 numpy loops of the papers' rules, in the edge cases
the per-algorithm tests leave out: rounds where some sampled devices never answer, a round where
none does, server_lr != 1 and server momentum under Scaffold.

* FedAdam / FedYogi / FedAdagrad (Reddi et al. 2021, Alg. 2: m, v from 0 and τ², no bias
  correction) and FedAvgM (v ← βv + Δ, x ← x − ηv) on the mean of the devices that answered; a
  round with no answer moves neither the model nor the optimizer's state (the next step is Alg. 2's
  next t, not one that saw a zero Δ).
* Scaffold (Karimireddy et al. 2020, option II): c ← c + (|S|/N) mean(Δc), S the devices that
  answered, not those sampled; the model by FedAvgM's step on y.
* FedGloSS (thesis Alg. 5 / CVPR 2025 Alg. 1): w̃ = w + ρ Δ̃/‖Δ̃‖, σ ← σ − (|S|/N)(x̄ − w̃)/β,
  w ← w − η Δ̃ − β σ, S again the devices that answered.

Every device is the real handler, every message goes through the wire codec (``run_round``); the
references use only what the devices uploaded.
"""

import numpy as np
import pytest

from aggregator.jobs.fedavg import FedAvgConfig, FedAvgJob
from aggregator.jobs.fedgloss import FedGlossConfig, FedGlossJob
from aggregator.jobs.robustness_fields import PLAIN_MEAN
from aggregator.jobs.scaffold import ScaffoldConfig, ScaffoldJob
from edge_client.state import DeviceStateStore
from edge_client.tasks.fedgloss_training import FedGlossTrainingTask
from edge_client.tasks.head_training import HeadTrainingTask
from edge_client.tasks.scaffold_training import ScaffoldTrainingTask
from protocols.payloads.fedavg import KIND as FEDAVG_KIND
from protocols.payloads.fedgloss import KIND as FEDGLOSS_KIND
from protocols.payloads.scaffold import KIND as SCAFFOLD_KIND

from stateful_jobs import pixel_extractor, run_round

C, D, SIZE, FLEET = 3, 8, 8, 5
HEAD = ("weight", "bias")
EXTRACTOR = pixel_extractor(SIZE, D)
BASE = dict(num_classes=C, feature_dim=D, image_size=SIZE, clients_per_round=3, local_epochs=1, batch_size=8,
            **PLAIN_MEAN)
# round -> the sampled devices that never answer (round 2: nobody answers)
SILENT = {1: ("dev1",), 2: tuple(f"dev{i}" for i in range(FLEET)), 3: ("dev0", "dev3")}


def local_data(i):
    rng = np.random.default_rng(i)
    n = 12 + 5 * i
    return rng.integers(0, 256, (n, SIZE, SIZE), dtype=np.uint8), rng.integers(0, C, n)


def fleet(make):
    return {f"dev{i}": make(i, *local_data(i)) for i in range(FLEET)}


def answered_mean(sent):
    """Σ n_k x_k / Σ n_k over the devices that answered (float64)."""
    total = sum(body["n"] for _, _, body, _ in sent.values())
    return {k: sum(body["n"] * out[k].astype(np.float64) for _, _, body, out in sent.values()) / total for k in HEAD}


def f64(tensors):
    return {k: np.asarray(tensors[k], np.float64) for k in HEAD}


class ServerLoop:
    """The papers' server steps, one coordinate array at a time, float64."""

    def __init__(self, optimizer, lr, momentum=0.0, beta1=0.9, beta2=0.99, tau=1e-3):
        self.optimizer, self.lr, self.momentum = optimizer, lr, momentum
        self.beta1, self.beta2, self.tau = beta1, beta2, tau
        self.state = {}

    def step(self, x, mean):
        out = {}
        for k in HEAD:
            if self.optimizer == "sgd":            # FedAvgM: pseudo-gradient x − x̄
                v = x[k] - mean[k] + self.momentum * self.state.get(k, 0.0)
                self.state[k] = v
                out[k] = x[k] - self.lr * v
                continue
            delta = mean[k] - x[k]
            m, v = self.state.get(k, (0.0, np.full_like(delta, self.tau ** 2)))
            m = self.beta1 * m + (1 - self.beta1) * delta
            if self.optimizer == "adam":
                v = self.beta2 * v + (1 - self.beta2) * delta ** 2
            elif self.optimizer == "adagrad":
                v = v + delta ** 2
            else:                                  # yogi: v moves towards Δ² additively
                v = v - (1 - self.beta2) * delta ** 2 * np.sign(v - delta ** 2)
            self.state[k] = (m, v)
            out[k] = x[k] + self.lr * m / (np.sqrt(v) + self.tau)
        return out


@pytest.mark.parametrize("optimizer, fields", [
    ("adam", {}), ("yogi", {}), ("adagrad", {}), ("sgd", {"server_momentum": 0.9})])
def test_server_optimizers_step_on_who_answered_and_an_empty_round_moves_nothing(optimizer, fields):
    handlers = fleet(lambda i, x, y: HeadTrainingTask(x, y, lambda *a, **k: EXTRACTOR))
    job = FedAvgJob(FedAvgConfig(rounds=5, client_lr=0.5, server_optimizer=optimizer, server_lr=0.3,
                                 **fields, **BASE))
    reference = ServerLoop(optimizer, 0.3, fields.get("server_momentum", 0.0))
    steps = 0
    for r in range(5):
        before = f64(job.params)
        sent = run_round(job, handlers, FEDAVG_KIND, silent=SILENT.get(r, ()))
        if not sent:
            assert all(np.array_equal(job.params[k], before[k].astype(np.float32)) for k in HEAD)
            assert job.strategy.steps == steps
            continue
        steps += 1
        want = reference.step(before, answered_mean(sent))
        for k in HEAD:
            np.testing.assert_allclose(job.params[k], want[k], rtol=1e-5, atol=1e-6)
    assert job.strategy.steps == steps == 4


def test_scaffold_moves_c_by_the_share_of_the_fleet_that_answered(tmp_path):
    handlers = fleet(lambda i, x, y: ScaffoldTrainingTask(x, y, lambda *a, **k: EXTRACTOR,
                                                          DeviceStateStore(tmp_path / f"dev{i}")))
    job = ScaffoldJob(ScaffoldConfig(rounds=5, client_lr=0.05, server_lr=0.6, server_momentum=0.5,
                                     total_devices=FLEET, **BASE))
    reference = ServerLoop("sgd", 0.6, 0.5)
    for r in range(5):
        w, c = f64(job.params), f64(job.control)
        sent = run_round(job, handlers, SCAFFOLD_KIND, silent=SILENT.get(r, ()))
        if not sent:
            assert all(np.array_equal(job.control[k], c[k].astype(np.float32)) for k in HEAD)
            continue
        want = reference.step(w, answered_mean(sent))
        for k in HEAD:
            np.testing.assert_allclose(job.params[k], want[k], rtol=1e-5, atol=1e-6)
            mean_dc = np.mean([out["delta_control." + k].astype(np.float64) for _, _, _, out in sent.values()], axis=0)
            np.testing.assert_allclose(job.control[k], c[k] + len(sent) / FLEET * mean_dc, rtol=1e-5, atol=1e-6)


def test_fedgloss_weighs_its_dual_step_by_the_share_that_answered(tmp_path):
    rho, beta, lr = 0.05, 2.0, 0.7
    handlers = fleet(lambda i, x, y: FedGlossTrainingTask(x, y, lambda *a, **k: EXTRACTOR,
                                                          DeviceStateStore(tmp_path / f"dev{i}")))
    job = FedGlossJob(FedGlossConfig(rounds=5, client_lr=0.05, server_lr=lr, fedgloss_rho=rho, admm_beta=beta,
                                     total_devices=FLEET, **BASE))
    pseudo_gradient, sigma = None, {k: 0.0 for k in HEAD}
    for r in range(5):
        w = f64(job.params)
        if pseudo_gradient is None:
            start = w
        else:
            norm = np.sqrt(sum(np.sum(v ** 2) for v in pseudo_gradient.values()))
            # the devices start from w̃ as sent, in the model's float32
            start = {k: (w[k] + rho * pseudo_gradient[k] / norm).astype(np.float32).astype(np.float64) for k in HEAD}
        sent = run_round(job, handlers, FEDGLOSS_KIND, silent=SILENT.get(r, ()))
        if not sent:
            assert all(np.array_equal(job.params[k], w[k].astype(np.float32)) for k in HEAD)
            continue
        for _, tensors, _, _ in sent.values():
            for k in HEAD:
                np.testing.assert_allclose(tensors[k], start[k], rtol=1e-6, atol=1e-7)
        mean = answered_mean(sent)
        sigma = {k: sigma[k] - len(sent) / FLEET * (mean[k] - start[k]) / beta for k in HEAD}
        pseudo_gradient = {k: start[k] - mean[k] for k in HEAD}
        for k in HEAD:
            np.testing.assert_allclose(job.params[k], w[k] - lr * pseudo_gradient[k] - beta * sigma[k],
                                       rtol=1e-5, atol=1e-6)
