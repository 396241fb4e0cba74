"""Parallel mask expansion (crypto.apply_masks with workers > 1, ServerSecAgg(workers=...)) gives
exactly the bits of the serial pass: against a textbook AES-ECB-of-counters reference and
against workers=1, for random lengths, seed counts, signs, worker counts and dropout patterns.
MASK_BLOCK_WORDS is shrunk in most tests so that short vectors are walked in many blocks."""

import hashlib
import os
import random

import numpy as np
import pytest
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes

from protocols.identity import DeviceIdentity, IdentityRegistry
from protocols.secagg import AggregateReady, Phase, RoundConfig
from protocols.secagg import crypto
from protocols.secagg import server as server_module
from protocols.secagg.driver import make_identities, plain_fixed_point_sum, run_round
from protocols.secagg.errors import ConfigError
from protocols.secagg.server import ServerSecAgg

AGGREGATOR = DeviceIdentity.generate("aggregator")
BOUND = 10.0


def _reference_mask(seed: bytes, length: int) -> np.ndarray:
    """Word stream = AES-128-ECB(key, counter_i), i = 0, 1, ... (128-bit big-endian)."""
    key = hashlib.sha256(b"fedfleet/secagg/prg/v1" + seed).digest()[:16]
    ecb = Cipher(algorithms.AES(key), modes.ECB()).encryptor()
    n_blocks = -(-length * 8 // 16)
    counters = b"".join(i.to_bytes(16, "big") for i in range(n_blocks))
    return np.frombuffer(ecb.update(counters), dtype="<u8")[:length].copy()


@pytest.fixture
def small_blocks(monkeypatch):
    """8-word blocks: a vector of a few hundred words is walked in dozens of blocks."""
    monkeypatch.setattr(crypto, "MASK_BLOCK_WORDS", 8)


@pytest.mark.parametrize("trial", range(12))
def test_parallel_equals_serial_and_reference(small_blocks, trial):
    rnd = random.Random(trial)
    length = rnd.choice([1, 2, 7, 8, 9, 16, 17, rnd.randint(18, 700)])
    workers = rnd.choice([2, 3, 4, 7, 64])
    signed_seeds = [(rnd.randbytes(32), rnd.choice((1, -1))) for _ in range(rnd.randint(1, 9))]
    start = np.frombuffer(rnd.randbytes(8 * length), dtype=np.uint64).copy()
    expected = start.copy()
    for seed, sign in signed_seeds:  # numpy uint64 wraps modulo 2^64
        mask = _reference_mask(seed, length)
        expected = expected + mask if sign > 0 else expected - mask
    serial, parallel = start.copy(), start.copy()
    crypto.apply_masks(serial, signed_seeds, workers=1)
    crypto.apply_masks(parallel, signed_seeds, workers=workers)
    assert np.array_equal(serial, expected)
    assert np.array_equal(parallel, expected)


def test_parallel_equals_serial_at_the_real_block_size():
    length = 3 * crypto.MASK_BLOCK_WORDS + 5  # four slices, the last one short
    signed_seeds = [(os.urandom(32), sign) for sign in (1, -1, -1)]
    serial, parallel = np.zeros(length, np.uint64), np.zeros(length, np.uint64)
    crypto.apply_masks(serial, signed_seeds, workers=1)
    crypto.apply_masks(parallel, signed_seeds, workers=4)
    assert np.array_equal(serial, parallel)
    assert np.array_equal(serial, -_reference_mask(signed_seeds[1][0], length) - _reference_mask(
        signed_seeds[2][0], length) + _reference_mask(signed_seeds[0][0], length))


@pytest.mark.parametrize("keys,workers", [(1, 1), (1, 5), (8, 3), (9, 3), (100, 3), (100, 100), (1000, 7)])
def test_key_groups_deal_every_key_once_in_balanced_groups(keys, workers):
    signed = [(i.to_bytes(16, "big"), 1 if i % 3 else -1) for i in range(keys)]
    groups = crypto.key_groups(signed, workers)
    assert len(groups) == min(keys, workers) and all(groups)
    assert sorted(key for group in groups for key in group) == sorted(signed)
    sizes = [len(group) for group in groups]
    assert max(sizes) - min(sizes) <= 1


@pytest.mark.parametrize("workers", [0, -1, 1.5, True, "2", None])
def test_bad_worker_counts_are_refused(workers):
    with pytest.raises(ValueError, match="workers"):
        crypto.apply_masks(np.zeros(4, np.uint64), [(b"s" * 32, 1)], workers=workers)


def test_default_workers_is_a_small_positive_count():
    assert 1 <= crypto.default_mask_workers() <= crypto.MAX_DEFAULT_MASK_WORKERS


def _config(n, m, seed):
    identities = {i.device_id: i for i in make_identities(n)}
    config = RoundConfig.create(job_id="par", round_id=seed, group_id="g", aggregator_id="aggregator",
                                members=list(identities), vector_length=m, bound=BOUND, graph="regular",
                                degree=4, consistency_check=False)
    rng = np.random.default_rng(seed)
    return config, identities, {d: rng.uniform(-BOUND, BOUND, m) for d in identities}


def test_server_rejects_bad_workers():
    config, identities, _ = _config(5, 4, seed=1)
    registry = IdentityRegistry({d: i.public_key_bytes for d, i in identities.items()})
    with pytest.raises(ConfigError, match="workers"):
        ServerSecAgg(config, AGGREGATOR, registry, workers=0)


@pytest.mark.parametrize("trial", range(4))
def test_server_unmasking_in_parallel_is_bit_identical_to_serial(small_blocks, monkeypatch, trial):
    """Random dropout patterns; the server removes masks with 1..5 threads. The masks it removes
    are applied again serially to a copy of the accumulator it had: same bits; and the sum is
    the plain sum of the survivors' encoded inputs."""
    rnd = random.Random(1000 + trial)
    n, m, workers = rnd.randint(8, 14), rnd.randint(20, 400), rnd.randint(2, 5)
    config, identities, inputs = _config(n, m, seed=1000 + trial)
    dropouts = {d: rnd.choice([Phase.SHARE_KEYS, Phase.MASKED_INPUT, Phase.UNMASK])
                for d in rnd.sample(config.members, rnd.randint(0, 2))}
    seen = []
    original = server_module.apply_masks

    def recording(accumulator, signed_seeds, workers=1):
        seen.append((accumulator.copy(), list(signed_seeds), workers))
        original(accumulator, signed_seeds, workers=workers)
        seen.append(accumulator.copy())

    monkeypatch.setattr(server_module, "apply_masks", recording)
    run = run_round(config, AGGREGATOR, identities, inputs, dropouts=dropouts, server_workers=workers)
    assert isinstance(run.outcome, AggregateReady), run.outcome
    (before, signed_seeds, used_workers), after = seen
    assert used_workers == workers and len(crypto.key_groups(signed_seeds, workers)) > 1
    serial = before.copy()
    original(serial, signed_seeds, workers=1)
    assert np.array_equal(after, serial)
    survivors = run.outcome.survivors
    assert np.array_equal(run.outcome.sum_words, plain_fixed_point_sum(config, [inputs[d] for d in survivors]))
