"""Fed3R's energy screen judges each device against the fleet without whichever one other device
raises the median most: no single device can lower the limit another device meets (a review's
finding: one low-energy device that added a class group took the class-balanced median down one
rank, the 5x between classes, and honest devices of a high-energy class were quarantined)."""

import numpy as np
import pytest

from aggregator.jobs.registry import build_job
from aggregator.strategies.robust_fed3r import EnergyScreen, median_without_another
from edge_client.fed3r import Fed3RAccumulator
from protocols.envelope import Envelope
from protocols.payloads.fed3r import encode_stats
from protocols.rounds import RoundClosed

from test_bounded_influence import class_balanced_median

# the review's fleet: class 5 at 0.27, class 0 at 1.0 (two devices), class 6 at 1.35 (two), 60 samples each
HONEST = {"five": (0.27, 5), "zero_a": (1.0, 0), "zero_b": (1.0, 0), "six_a": (1.35, 6), "six_b": (1.35, 6)}


def brute_force(values: dict, classes: dict | None) -> dict:
    """max over j ≠ d of the reference class-balanced median of the fleet without j, recomputed per j."""
    groups = classes if classes is not None else {d: None for d in values}
    without = {j: class_balanced_median({d: v for d, v in values.items() if d != j}, groups) for j in values}
    return {d: max(m for j, m in without.items() if j != d) for d in values}


@pytest.mark.parametrize("liar", [("all-zero features", 0.0), ("low-energy images relabelled", 0.27)])
def test_one_device_adding_a_low_class_group_gets_no_honest_device_screened(liar):
    """The review's repro: the honest fleet's median is 1.0 and nobody is screened; one device of
    class 9 (no honest device holds it) at energy 0 or 0.27 took the median to 0.27 and screened both
    class-6 devices (5x, limit 3.73x). Judged against the fleet without another device, they are not."""
    _, energy = liar
    screen = EnergyScreen(2.5, 5, 9.5, 100)
    energies = {d: e for d, (e, _) in HONEST.items()}
    classes = {d: c for d, (_, c) in HONEST.items()}
    samples = {d: 60 for d in energies}
    assert screen.outliers(energies, samples, classes) == {}
    energies["liar"], classes["liar"], samples["liar"] = energy, 9, 60
    assert class_balanced_median(energies, classes) == 0.27          # what the screen judged by before
    assert screen.judged_medians(energies, classes) == brute_force(energies, classes)
    assert screen.outliers(energies, samples, classes) == {}


def test_the_job_keeps_honest_high_energy_devices_beside_a_device_of_zero_features():
    """The same through the Fed3R job with its default screen: the all-zero device passes every hard
    bound, and it no longer gets the class-6 devices screened (so quarantined, and class 6 out)."""
    num_classes, dim = 10, 4
    job = build_job("fed3r", {"num_classes": num_classes, "feature_dim": dim, "clients_per_round": 6})
    fleet = {**HONEST, "liar": (0.0, 9)}
    for d, (energy, label) in fleet.items():
        features = np.full((60, dim), np.sqrt(energy / dim))            # energy per sample = energy
        job.apply(d, job.parse_result(_envelope(d, features, np.full(60, label), num_classes, dim)))
    job.close_round(RoundClosed(1, tuple(fleet), (), (), ()))
    assert job.classes == {d: c for d, (_, c) in fleet.items()}
    assert job.screened_out == {}


def _envelope(device, features, labels, num_classes, dim):
    acc = Fed3RAccumulator(num_classes, dim)
    acc.update(features, labels)
    A, ids, b = acc.sparse()
    return Envelope("result", device, *encode_stats(A, ids, b, acc.n, num_classes))


def test_one_device_of_one_sample_gets_no_honest_device_screened_by_its_count():
    """The samples-ratio screen the same way: honest n of 2, 2, 250, 250, 250 have median 250; one
    device claiming n = 1 took it to 2 and screened the three 250-sample devices (125x, limit 100x)."""
    screen = EnergyScreen(2.5, 5, 9.5, 100)
    samples = {"a": 2, "b": 2, "c": 250, "d": 250, "e": 250}
    energies = {d: 1.0 for d in samples}
    assert screen.outliers(energies, samples) == {}
    samples["liar"], energies["liar"] = 1, 1.0
    assert sorted(samples.values())[(len(samples) - 1) // 2] == 2     # the median n it was judged by
    assert screen.outliers(energies, samples) == {}
    samples["claims"], energies["claims"] = 100_000, 1.0              # a device claiming far more still is
    assert list(screen.outliers(energies, samples)) == ["claims"]


@pytest.mark.parametrize("seed", range(8))
def test_the_fast_leave_one_out_is_the_brute_force_recomputation(seed):
    """Exactly the O(N²) recomputation on random fleets (40 a seed): groups of 1, 2, 3 and more
    devices, a group of unknown classes, tied energies (small integers on odd seeds), and the
    screen's verdicts from it."""
    rng = np.random.default_rng(seed)
    for _ in range(40):
        sizes = list(rng.choice([1, 1, 2, 2, 3, 4, 5, 7], size=rng.integers(1, 9)))
        classes, energies = {}, {}
        for group, size in enumerate(sizes):
            for k in range(size):
                d = f"g{group}d{k}"
                classes[d] = None if group == 0 else group
                energies[d] = float(rng.integers(0, 4)) if seed % 2 else float(rng.lognormal(0, 1))
        if len(energies) < 2:
            energies["extra"], classes["extra"] = 1.0, 1
        assert median_without_another(energies, classes) == brute_force(energies, classes)
        assert median_without_another(energies) == brute_force(energies, None)
        samples = {d: int(rng.integers(1, 300)) for d in energies}
        screen = EnergyScreen(2.5, 2, 9.5, 3)
        judged = brute_force(energies, classes)
        judged_n = brute_force({d: float(n) for d, n in samples.items()}, None)
        want = {d for d in energies if (judged[d] > 0 and energies[d] > screen.limit_ratio(samples[d]) * judged[d])
                or samples[d] > 3 * judged_n[d]}
        assert set(screen.outliers(energies, samples, classes)) == want
        # a device above the median it is judged by was above the fleet's median too: the rule
        # screens no energy the fleet's own median kept
        full = class_balanced_median(energies, classes)
        assert all(judged[d] >= full for d in energies if energies[d] > judged[d])


def test_single_device_and_single_group_fleets():
    assert median_without_another({"a": 3.0}) == {"a": 3.0}
    assert median_without_another({"a": 3.0, "b": 5.0}) == {"a": 3.0, "b": 5.0}     # only itself left
    values = {"a": 1.0, "b": 1.0, "c": 4.0, "d": 9.0}
    assert median_without_another(values) == brute_force(values, None) == {"a": 4.0, "b": 4.0, "c": 4.0, "d": 4.0}
