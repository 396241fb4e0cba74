"""Server-side mask expansion: the GPU and worker-process appliers (aggregator/compute/mask_expansion.py)
and the ServerSecAgg hook they plug into.

On CPU-only machines (CI) the AES tables and key schedule the kernel uses are checked by an
independent numpy T-table AES run against `cryptography`'s AES-128-CTR (protocols' apply_masks),
and a whole SecAgg+ round unmasked through that numpy applier must equal the plain sum. With a
GPU and Triton, the kernel itself must reproduce apply_masks bit for bit.
"""

from __future__ import annotations

import os

import numpy as np
import pytest

from aggregator.compute.mask_expansion import (CudaMaskApplier, ProcessMaskApplier, aes128_round_keys, aes_sbox,
                                       aes_t_tables, pick_mask_applier, triton_available)
from protocols.identity import DeviceIdentity
from protocols.secagg import AggregateReady, Phase, RoundConfig
from protocols.secagg.crypto import MAX_DEFAULT_MASK_WORKERS, apply_masks, prg_keys, usable_cores
from protocols.secagg.driver import make_identities, run_round


def _gpu_ready() -> bool:
    import torch

    return torch.cuda.is_available() and triton_available()


needs_gpu = pytest.mark.skipif(not _gpu_ready(), reason="needs a CUDA GPU and Triton (the CPU build has neither)")


def numpy_aes_ctr_words(round_keys: np.ndarray, n_words: int) -> np.ndarray:
    """AES-128-CTR keystream words 0..n_words-1 from a key schedule, with the T-tables, written
    independently of the kernel: the state is indexed by column (i + j) % 4 instead of spelled out."""
    te, sbox = aes_t_tables(), aes_sbox()
    blocks = -(-n_words // 2)
    counter = np.arange(blocks, dtype=np.uint64)
    state = [np.full(blocks, round_keys[0], np.uint32), np.full(blocks, round_keys[1], np.uint32),
             (counter >> np.uint64(32)).astype(np.uint32) ^ round_keys[2],
             (counter & np.uint64(0xFFFFFFFF)).astype(np.uint32) ^ round_keys[3]]
    for r in range(1, 10):
        state = [te[0][state[i] >> 24] ^ te[1][(state[(i + 1) % 4] >> 16) & 0xFF]
                 ^ te[2][(state[(i + 2) % 4] >> 8) & 0xFF] ^ te[3][state[(i + 3) % 4] & 0xFF] ^ round_keys[4 * r + i]
                 for i in range(4)]
    out = [(sbox[state[i] >> 24] << 24) ^ (sbox[(state[(i + 1) % 4] >> 16) & 0xFF] << 16)
           ^ (sbox[(state[(i + 2) % 4] >> 8) & 0xFF] << 8) ^ sbox[state[(i + 3) % 4] & 0xFF] ^ round_keys[40 + i]
           for i in range(4)]
    keystream = np.stack(out, axis=1).astype(">u4").tobytes()
    return np.frombuffer(keystream, dtype="<u8")[:n_words]


def numpy_mask_applier(accumulator: np.ndarray, signed_seeds) -> None:
    keys = prg_keys(signed_seeds)
    schedules = aes128_round_keys([key for key, _ in keys])
    for schedule, (_, sign) in zip(schedules, keys):
        words = numpy_aes_ctr_words(schedule, accumulator.size)
        if sign > 0:
            np.add(accumulator, words, out=accumulator)
        else:
            np.subtract(accumulator, words, out=accumulator)


def test_sbox_is_a_permutation_with_the_standard_fixed_values():
    sbox = aes_sbox()
    assert sorted(sbox.tolist()) == list(range(256))
    # FIPS-197 fig. 7: S(00) = 63, S(53) = ed, S(ff) = 16
    assert (sbox[0x00], sbox[0x53], sbox[0xFF]) == (0x63, 0xED, 0x16)


def test_key_schedule_matches_fips197_appendix_a():
    schedule = aes128_round_keys([bytes.fromhex("2b7e151628aed2a6abf7158809cf4f3c")])[0]
    assert schedule[4] == 0xA0FAFE17 and schedule[43] == 0xB6630CA6


@pytest.mark.parametrize("n_words", [1, 2, 7, 1000, 4097])
def test_numpy_t_table_aes_equals_cryptography_keystream(n_words):
    """The tables and key schedules the GPU kernel reads produce the protocol's mask words."""
    rng = np.random.default_rng(n_words)
    seeds = [(os.urandom(32), int(sign)) for sign in rng.choice([-1, 1], size=3)]
    expected = rng.integers(0, 2**63, n_words, dtype=np.uint64)
    mine = expected.copy()
    apply_masks(expected, seeds)
    numpy_mask_applier(mine, seeds)
    np.testing.assert_array_equal(mine, expected)


def test_server_unmasks_through_a_custom_applier():
    """A SecAgg+ round with drop-outs after ShareKeys, unmasked through the numpy applier,
    equals the plain fixed-point sum of the survivors' inputs."""
    identities = {i.device_id: i for i in make_identities(12)}
    config = RoundConfig.create(job_id="j", round_id=1, group_id="g", aggregator_id="aggregator",
                                members=list(identities), vector_length=257, bound=1.0, graph="regular")
    rng = np.random.default_rng(3)
    inputs = {device: rng.uniform(-1, 1, 257) for device in identities}
    calls = []

    def applier(accumulator, signed_seeds):
        calls.append(len(signed_seeds))
        numpy_mask_applier(accumulator, signed_seeds)

    run = run_round(config, DeviceIdentity.generate("aggregator"), identities, inputs,
                    dropouts={config.members[0]: Phase.MASKED_INPUT, config.members[5]: Phase.MASKED_INPUT},
                    server_mask_applier=applier)
    assert isinstance(run.outcome, AggregateReady)
    survivors = run.outcome.survivors
    assert len(survivors) == 10 and calls and calls[0] > len(survivors)   # pair masks of the dropped too
    expected = np.zeros(257, dtype=np.uint64)
    for device in survivors:
        expected += config.codec.encode(inputs[device])
    np.testing.assert_array_equal(run.outcome.sum_words, expected)


def _cpu_choice():
    return ProcessMaskApplier if usable_cores() > MAX_DEFAULT_MASK_WORKERS else type(None)


def test_pick_mask_applier_choices(monkeypatch):
    monkeypatch.delenv("FEDFLEET_DEVICE", raising=False)
    assert isinstance(pick_mask_applier("cpu"), _cpu_choice())   # processes beyond the threads' useful count
    with pytest.raises(ValueError, match="auto, cpu or cuda"):
        pick_mask_applier("tpu")
    monkeypatch.setenv("FEDFLEET_DEVICE", "cpu")     # the aggregator's device override holds here too
    assert isinstance(pick_mask_applier("auto"), _cpu_choice())
    monkeypatch.delenv("FEDFLEET_DEVICE")
    if not _gpu_ready():
        assert isinstance(pick_mask_applier("auto"), _cpu_choice())
        with pytest.raises(RuntimeError, match="no GPU|Triton"):
            pick_mask_applier("cuda")
    else:
        assert isinstance(pick_mask_applier("auto"), CudaMaskApplier)
        assert pick_mask_applier("auto") is pick_mask_applier("cuda:0")    # one compiled applier per GPU


@pytest.fixture(scope="module")
def process_applier():
    applier = ProcessMaskApplier(3).warm_up()   # more processes than CI's 2 cores
    yield applier
    applier.close()


@pytest.mark.parametrize("word", [np.uint64, np.uint32])
@pytest.mark.parametrize("n_words", [1, 5, 3 * 32768 + 7, 200_000])
@pytest.mark.parametrize("n_seeds", [1, 2, 10])     # fewer seeds than processes, and uneven groups
def test_process_applier_is_bit_identical_to_apply_masks(process_applier, n_words, word, n_seeds):
    rng = np.random.default_rng(n_words)
    seeds = [(os.urandom(32), int(sign)) for sign in rng.choice([-1, 1], size=n_seeds)]
    expected = rng.integers(0, np.iinfo(word).max, n_words, dtype=word)
    mine = expected.copy()
    apply_masks(expected, seeds)
    process_applier(mine, seeds)
    np.testing.assert_array_equal(mine, expected)


def test_process_applier_unmasks_a_round_and_refuses_bad_input(process_applier):
    identities = {i.device_id: i for i in make_identities(10)}
    config = RoundConfig.create(job_id="j", round_id=1, group_id="g", aggregator_id="aggregator",
                                members=list(identities), vector_length=70_001, bound=1.0, graph="regular")
    rng = np.random.default_rng(5)
    inputs = {device: rng.uniform(-1, 1, 70_001) for device in identities}
    run = run_round(config, DeviceIdentity.generate("aggregator"), identities, inputs,
                    dropouts={config.members[2]: Phase.MASKED_INPUT}, server_mask_applier=process_applier)
    assert isinstance(run.outcome, AggregateReady)
    expected = np.zeros(70_001, dtype=np.uint64)
    for device in run.outcome.survivors:
        expected += config.codec.encode(inputs[device])
    np.testing.assert_array_equal(run.outcome.sum_words, expected)
    with pytest.raises(TypeError, match="uint64"):
        process_applier(np.zeros(4, dtype=np.int64), [(b"s", 1)])
    with pytest.raises(ValueError, match="sign"):
        process_applier(np.zeros(4, dtype=np.uint64), [(b"s", 0)])
    with pytest.raises(ValueError, match="workers"):
        ProcessMaskApplier(0)


def test_a_killed_worker_fails_the_call_with_its_error_and_the_next_call_recovers():
    """A worker killed (the kernel's OOM killer) broke the pool for good: every later round's
    unmasking failed. The call that meets it fails with the cause; its shared blocks go; the next starts new workers."""
    import signal
    from concurrent.futures.process import BrokenProcessPool

    applier = ProcessMaskApplier(2).warm_up()
    try:
        seeds = [(os.urandom(32), 1) for _ in range(4)]
        before = set(os.listdir("/dev/shm"))
        for pid in list(applier._pool._processes):
            os.kill(pid, signal.SIGKILL)
        with pytest.raises(BrokenProcessPool):
            applier(np.zeros(3 * 32768, dtype=np.uint64), seeds)
        assert set(os.listdir("/dev/shm")) <= before          # the call's blocks are gone
        expected, mine = np.arange(1000, dtype=np.uint64), np.arange(1000, dtype=np.uint64)
        apply_masks(expected, seeds)
        applier(mine, seeds)
        np.testing.assert_array_equal(mine, expected)
    finally:
        applier.close()


@needs_gpu
@pytest.mark.parametrize("word", [np.uint64, np.uint32])       # uint32: the applier's CPU path
@pytest.mark.parametrize("n_words", [1, 3, 32768 + 1, 1_000_000])
def test_gpu_applier_is_bit_identical_to_apply_masks(n_words, word):
    rng = np.random.default_rng(n_words)
    seeds = [(os.urandom(32), int(sign)) for sign in rng.choice([-1, 1], size=37)]
    expected = rng.integers(0, np.iinfo(word).max, n_words, dtype=word)
    mine = expected.copy()
    apply_masks(expected, seeds, workers=2)
    CudaMaskApplier(keys_per_launch=8)(mine, seeds)        # several launches
    np.testing.assert_array_equal(mine, expected)


@needs_gpu
def test_gpu_applier_refuses_bad_input():
    applier = CudaMaskApplier()
    with pytest.raises(TypeError, match="uint64"):
        applier(np.zeros(4, dtype=np.int64), [(b"s", 1)])
    with pytest.raises(ValueError, match="sign"):
        applier(np.zeros(4, dtype=np.uint64), [(b"s", 2)])
