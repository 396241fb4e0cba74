"""Secure aggregation's final unmasking, accelerated: AES-128-CTR mask expansion in one CUDA
kernel, or on every CPU core in worker processes.

Why. At the end of a SecAgg(+) round the server removes every mask still in the sum: one
self-mask per survivor and, per dropped device, one pair mask per surviving neighbour -- at
n = 1000, m = 10^6 with 10 % drop-out about 2 700 keystreams of 8 MB, ~22 GB of AES-CTR. On
CPU that is bound by AES-NI throughput (crypto.apply_masks, a few GB/s per core); on an H100
this kernel ran 30-36x one core's raw AES-CTR (bench/secagg.py prints the ratio), and the
round's unmasking stops dominating its cost.

What. `CudaMaskApplier` is a `protocols.secagg.MaskApplier`: accumulator += sum(sign * PRG(seed))
mod 2^64, bit-identical to `protocols.secagg.crypto.apply_masks` (the PRG is the protocol's:
AES-128 keyed by `crypto.prg_key(seed)`, 128-bit big-endian counter from 0, keystream read as
little-endian uint64 words). The host expands the AES key schedules of all seeds at once
(numpy, vectorised over seeds); one Triton kernel then gives each GPU thread a few counter
blocks, runs every seed's AES over them with the classic four 1 KiB T-tables (they stay in L1),
and adds the signed keystream words into registers before touching the accumulator once.
No keystream is ever written to GPU memory.

Without a GPU, `ProcessMaskApplier` spreads the same work over worker processes. Threads
(crypto.apply_masks' `workers`) stop scaling at about 4 because every keystream block hands the
GIL over twice (2 700 masks of 10^6 words on a 16-core Xeon: x2.6 with 4 threads, x2.6 with 8);
processes have no GIL to share. The seeds are dealt into one group per process (the threads'
`key_groups`); each process applies its group to the whole vector in a shared-memory block of its
own (the first holds the accumulator, the others start at zero) and the blocks are added up, so
the bits are the same; and the pool is started once (forks of the service's fork server,
aggregator/compute/fork_server.py: never a fork of this multi-threaded server) and kept for the
process's life.

`pick_mask_applier()` returns the GPU applier when torch sees a GPU and Triton imports, the
process applier on a CPU with more usable cores than the thread path can use, else None
(ServerSecAgg then uses crypto.apply_masks on CPU threads). The CPU build of torch has no
Triton, so CI runs the CPU paths (both appliers are compared bit for bit with
crypto.apply_masks there), and the kernel's bits are checked on the GPU machine
(tests/test_mask_expansion.py).
"""

from __future__ import annotations

from concurrent.futures.process import BrokenProcessPool
import logging
from functools import lru_cache
from typing import Sequence

import numpy as np

from protocols.secagg.crypto import (MASK_BLOCK_WORDS, MAX_DEFAULT_MASK_WORKERS, apply_masks, apply_masks_to_slice,
                                     check_accumulator, check_workers, default_mask_workers, key_groups,
                                     prg_keys, usable_cores)

from aggregator.compute.device import pick_device

log = logging.getLogger("fedfleet.aggregator.compute.mask_expansion")

AES128_ROUNDS = 10
ROUND_KEY_WORDS = 4 * (AES128_ROUNDS + 1)   # 44 big-endian uint32 words per key
_RCON = (0x01, 0x02, 0x04, 0x08, 0x10, 0x20, 0x40, 0x80, 0x1B, 0x36)


def _xtime(value: np.ndarray) -> np.ndarray:
    """Multiplication by x (i.e. 2) in AES's GF(2^8)."""
    return ((value << 1) ^ np.where(value & 0x80, 0x1B, 0)) & 0xFF


@lru_cache(maxsize=1)
def aes_sbox() -> np.ndarray:
    """The AES S-box (uint32[256]), computed from its definition: inverse in GF(2^8), then the
    affine map -- no 256-entry literal to mistype."""
    exp = np.zeros(256, dtype=np.int64)
    log_table = np.zeros(256, dtype=np.int64)
    value = 1
    for power in range(255):            # 3 generates GF(2^8)*
        exp[power] = value
        log_table[value] = power
        value ^= int(_xtime(np.int64(value)))    # value * 3 = value * 2 + value
    sbox = np.zeros(256, dtype=np.uint32)
    for byte in range(256):
        inverse = 0 if byte == 0 else int(exp[(255 - log_table[byte]) % 255])
        out = inverse
        for shift in (1, 2, 3, 4):
            out ^= ((inverse << shift) | (inverse >> (8 - shift))) & 0xFF
        sbox[byte] = out ^ 0x63
    return sbox


@lru_cache(maxsize=1)
def aes_t_tables() -> np.ndarray:
    """uint32[4, 256]: Te0..Te3 of the T-table formulation of an AES encryption round (SubBytes,
    ShiftRows' byte choice and MixColumns folded into four lookups per output column)."""
    s = aes_sbox().astype(np.int64)
    te0 = (_xtime(s) << 24) | (s << 16) | (s << 8) | (_xtime(s) ^ s)
    tables = [te0]
    for _ in range(3):   # Te_{i+1} = Te_i rotated right by one byte
        tables.append(((tables[-1] >> 8) | (tables[-1] << 24)) & 0xFFFFFFFF)
    return np.stack(tables).astype(np.uint32)


def aes128_round_keys(keys: Sequence[bytes]) -> np.ndarray:
    """uint32[len(keys), 44]: the AES-128 key schedules, as big-endian words, vectorised over keys."""
    raw = np.frombuffer(b"".join(keys), dtype=">u4")
    if any(len(key) != 16 for key in keys):
        raise ValueError("AES-128 keys are 16 bytes")
    words = np.zeros((len(keys), ROUND_KEY_WORDS), dtype=np.uint32)
    words[:, :4] = raw.reshape(len(keys), 4)
    sbox = aes_sbox()
    for i in range(4, ROUND_KEY_WORDS):
        temp = words[:, i - 1]
        if i % 4 == 0:
            rotated = (temp << np.uint32(8)) | (temp >> np.uint32(24))
            temp = ((sbox[rotated >> 24] << 24) | (sbox[(rotated >> 16) & 0xFF] << 16)
                    | (sbox[(rotated >> 8) & 0xFF] << 8) | sbox[rotated & 0xFF]).astype(np.uint32)
            temp ^= np.uint32(_RCON[i // 4 - 1] << 24)
        words[:, i] = words[:, i - 4] ^ temp
    return words


def triton_available() -> bool:
    try:
        import triton  # noqa: F401
        import triton.language  # noqa: F401
    except Exception:   # not installed (CPU torch), or a broken install: the CPU path is used
        return False
    return True


@lru_cache(maxsize=1)
def _kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def load_u32(pointer):
        return tl.load(pointer).to(tl.uint32, bitcast=True)

    @triton.jit
    def te(tables, which: tl.constexpr, index):
        return tl.load(tables + which * 256 + index).to(tl.uint32, bitcast=True)

    @triton.jit
    def bswap32(x):
        return ((x & 0xFF) << 24) | ((x & 0xFF00) << 8) | ((x >> 8) & 0xFF00) | (x >> 24)

    # one compiled variant whatever the vector length and key count (no recompiles mid-round)
    @triton.jit(do_not_specialize=["n_words", "n_keys"])
    def aes_ctr_masks(accumulator, n_words, round_keys, signs, n_keys, tables, sbox,
                      BLOCKS: tl.constexpr):
        # counter block p covers words 2p, 2p+1; its 128-bit big-endian value is p
        block = tl.program_id(0).to(tl.int64) * BLOCKS + tl.arange(0, BLOCKS).to(tl.int64)
        counter_hi = (block >> 32).to(tl.uint32)
        counter_lo = (block & 0xFFFFFFFF).to(tl.uint32)
        zero = tl.zeros([BLOCKS], dtype=tl.uint32)
        sum_lo = tl.zeros([BLOCKS], dtype=tl.uint64)
        sum_hi = tl.zeros([BLOCKS], dtype=tl.uint64)
        for key in range(n_keys):
            rk = round_keys + key * 44
            s0 = zero ^ load_u32(rk)
            s1 = zero ^ load_u32(rk + 1)
            s2 = counter_hi ^ load_u32(rk + 2)
            s3 = counter_lo ^ load_u32(rk + 3)
            for r in tl.static_range(1, 10):
                t0 = (te(tables, 0, s0 >> 24) ^ te(tables, 1, (s1 >> 16) & 0xFF) ^ te(tables, 2, (s2 >> 8) & 0xFF)
                      ^ te(tables, 3, s3 & 0xFF) ^ load_u32(rk + 4 * r))
                t1 = (te(tables, 0, s1 >> 24) ^ te(tables, 1, (s2 >> 16) & 0xFF) ^ te(tables, 2, (s3 >> 8) & 0xFF)
                      ^ te(tables, 3, s0 & 0xFF) ^ load_u32(rk + 4 * r + 1))
                t2 = (te(tables, 0, s2 >> 24) ^ te(tables, 1, (s3 >> 16) & 0xFF) ^ te(tables, 2, (s0 >> 8) & 0xFF)
                      ^ te(tables, 3, s1 & 0xFF) ^ load_u32(rk + 4 * r + 2))
                t3 = (te(tables, 0, s3 >> 24) ^ te(tables, 1, (s0 >> 16) & 0xFF) ^ te(tables, 2, (s1 >> 8) & 0xFF)
                      ^ te(tables, 3, s2 & 0xFF) ^ load_u32(rk + 4 * r + 3))
                s0, s1, s2, s3 = t0, t1, t2, t3
            # last round: SubBytes + ShiftRows, no MixColumns
            o0 = ((te(sbox, 0, s0 >> 24) << 24) ^ (te(sbox, 0, (s1 >> 16) & 0xFF) << 16)
                  ^ (te(sbox, 0, (s2 >> 8) & 0xFF) << 8) ^ te(sbox, 0, s3 & 0xFF) ^ load_u32(rk + 40))
            o1 = ((te(sbox, 0, s1 >> 24) << 24) ^ (te(sbox, 0, (s2 >> 16) & 0xFF) << 16)
                  ^ (te(sbox, 0, (s3 >> 8) & 0xFF) << 8) ^ te(sbox, 0, s0 & 0xFF) ^ load_u32(rk + 41))
            o2 = ((te(sbox, 0, s2 >> 24) << 24) ^ (te(sbox, 0, (s3 >> 16) & 0xFF) << 16)
                  ^ (te(sbox, 0, (s0 >> 8) & 0xFF) << 8) ^ te(sbox, 0, s1 & 0xFF) ^ load_u32(rk + 42))
            o3 = ((te(sbox, 0, s3 >> 24) << 24) ^ (te(sbox, 0, (s0 >> 16) & 0xFF) << 16)
                  ^ (te(sbox, 0, (s1 >> 8) & 0xFF) << 8) ^ te(sbox, 0, s2 & 0xFF) ^ load_u32(rk + 43))
            # keystream bytes o0..o3 (big-endian) read as two little-endian uint64 words
            word_lo = bswap32(o0).to(tl.uint64) | (bswap32(o1).to(tl.uint64) << 32)
            word_hi = bswap32(o2).to(tl.uint64) | (bswap32(o3).to(tl.uint64) << 32)
            sign = tl.load(signs + key).to(tl.uint64, bitcast=True)   # 1 or 2^64 - 1
            sum_lo += word_lo * sign
            sum_hi += word_hi * sign
        lo_index = block * 2
        hi_index = lo_index + 1
        lo_ok = lo_index < n_words
        hi_ok = hi_index < n_words
        acc_lo = tl.load(accumulator + lo_index, mask=lo_ok, other=0).to(tl.uint64, bitcast=True)
        acc_hi = tl.load(accumulator + hi_index, mask=hi_ok, other=0).to(tl.uint64, bitcast=True)
        tl.store(accumulator + lo_index, (acc_lo + sum_lo).to(tl.int64, bitcast=True), mask=lo_ok)
        tl.store(accumulator + hi_index, (acc_hi + sum_hi).to(tl.int64, bitcast=True), mask=hi_ok)

    return triton, aes_ctr_masks


class CudaMaskApplier:
    """accumulator += sum(sign * PRG(seed)) mod 2^64 on a CUDA device (a MaskApplier).

    `blocks_per_program`: AES counter blocks each Triton program handles (a power of two; 256
    was fastest on an H100, `bench/secagg.py` prints the sweep); `keys_per_launch` bounds one
    launch's work so a huge unmasking never runs as one long kernel."""

    def __init__(self, device: str = "cuda", blocks_per_program: int = 256, keys_per_launch: int = 512) -> None:
        import torch

        if not torch.cuda.is_available():
            raise RuntimeError("CudaMaskApplier needs a CUDA GPU; without one ServerSecAgg uses "
                               "protocols.secagg.crypto.apply_masks on CPU threads")
        if not triton_available():
            raise RuntimeError("CudaMaskApplier needs Triton (shipped with CUDA builds of torch)")
        if blocks_per_program < 1 or blocks_per_program & (blocks_per_program - 1):
            raise ValueError("blocks_per_program must be a power of two")
        if keys_per_launch < 1:
            raise ValueError("keys_per_launch must be >= 1")
        self.torch = torch
        self.device = torch.device(device)
        self.blocks_per_program = blocks_per_program
        self.keys_per_launch = keys_per_launch
        self._tables = torch.from_numpy(aes_t_tables().reshape(-1).view(np.int32).copy()).to(self.device)
        self._sbox = torch.from_numpy(aes_sbox().view(np.int32).copy()).to(self.device)
        self(np.zeros(2, dtype=np.uint64), [(bytes(32), 1)])   # compile the kernel now, not mid-round

    def __call__(self, accumulator: np.ndarray, signed_seeds: Sequence[tuple[bytes, int]]) -> None:
        check_accumulator(accumulator)
        if accumulator.dtype != np.uint64:
            # the kernel adds 64-bit words; a 32-bit ring's masks (the same keystream cut into
            # words half as wide) are expanded on CPU threads, the CPU path's bits by definition
            apply_masks(accumulator, signed_seeds, workers=default_mask_workers())
            return
        keys = prg_keys(signed_seeds)
        if not keys or accumulator.size == 0:
            return
        torch = self.torch
        triton, kernel = _kernel()
        schedules = aes128_round_keys([key for key, _ in keys]).view(np.int32)
        signs = np.array([sign for _, sign in keys], dtype=np.int64)
        on_device = torch.from_numpy(accumulator.view(np.int64)).to(self.device)
        blocks = -(-accumulator.size // 2)
        grid = (triton.cdiv(blocks, self.blocks_per_program),)
        for start in range(0, len(keys), self.keys_per_launch):
            stop = min(start + self.keys_per_launch, len(keys))
            kernel[grid](on_device, accumulator.size,
                         torch.from_numpy(np.ascontiguousarray(schedules[start:stop])).to(self.device),
                         torch.from_numpy(signs[start:stop]).to(self.device), stop - start,
                         self._tables, self._sbox, BLOCKS=self.blocks_per_program)
        accumulator.view(np.int64)[:] = on_device.cpu().numpy()


def apply_masks_in_shared_memory(name: str, length: int, keys: Sequence[tuple[bytes, int]],
                                 dtype: str = "uint64") -> None:
    """Worker-process entry of a multi-process applier: the vector of `length` ring words
    (`dtype`) in the shared memory block `name` += sum(sign * PRG) under the AES keys `keys` (from
    prg_keys). It lives at module level so a forkserver worker can import it cheaply."""
    from multiprocessing import shared_memory

    block = shared_memory.SharedMemory(name=name)
    try:
        vector = np.ndarray((length,), dtype=np.dtype(dtype), buffer=block.buf)
        apply_masks_to_slice(vector, keys, 0)
        del vector          # no view may outlive close()
    finally:
        block.close()


class ProcessMaskApplier:
    """accumulator += sum(sign * PRG(seed)) mod 2^64 (2^32) with `processes` worker processes (a
    MaskApplier), bit-identical to crypto.apply_masks."""

    def __init__(self, processes: int) -> None:
        self.processes = check_workers(processes)
        self._pool = None

    def _executor(self):
        if self._pool is None:
            from concurrent.futures import ProcessPoolExecutor

            from aggregator.compute.fork_server import fork_server_context

            self._pool = ProcessPoolExecutor(self.processes, mp_context=fork_server_context(__name__))
        return self._pool

    def warm_up(self) -> "ProcessMaskApplier":
        """Start every worker and import its code now (about a second), not in the first round's
        unmasking: one tiny job per worker, all in flight at once."""
        signed = [(bytes([i]) * 32, 1) for i in range(self.processes)]     # one seed per worker
        for _ in range(2):     # workers start on demand; a second wave reaches the late ones
            self(np.zeros(2 * MASK_BLOCK_WORDS, dtype=np.uint64), signed)
        return self

    def __call__(self, accumulator: np.ndarray, signed_seeds: Sequence[tuple[bytes, int]]) -> None:
        from multiprocessing import shared_memory

        check_accumulator(accumulator)
        keys = prg_keys(signed_seeds)
        if not keys or accumulator.size == 0:
            return
        groups = key_groups(keys, self.processes)
        blocks, shared = [], []
        try:
            for _ in groups:        # a new block reads as zeros: the groups after the first start there
                blocks.append(shared_memory.SharedMemory(create=True, size=accumulator.nbytes))
            shared = [np.ndarray(accumulator.shape, dtype=accumulator.dtype, buffer=block.buf) for block in blocks]
            shared[0][:] = accumulator
            futures = [self._executor().submit(apply_masks_in_shared_memory, block.name, accumulator.size, group,
                                               accumulator.dtype.name)
                       for block, group in zip(blocks, groups)]
            for future in futures:
                future.result()          # re-raises a worker's exception here
            accumulator[:] = shared[0]
            for index in range(1, len(shared)):
                np.add(accumulator, shared[index], out=accumulator)
        except BrokenProcessPool:
            self.close()                # a worker died (killed, out of memory): the next call starts new ones
            raise
        finally:
            shared.clear()              # no view may outlive close(), whatever raised
            for block in blocks:
                block.close()
                block.unlink()

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(cancel_futures=True)
            self._pool = None


def mask_expansion_plan(preference: str = "auto") -> tuple[str, str | int]:
    """Where pick_mask_applier would expand masks, without building anything: ("cuda", device),
    ("processes", n) or ("threads", n)."""
    if preference not in ("auto", "cpu", "cuda") and not preference.startswith("cuda:"):
        raise ValueError(f"mask expansion device must be auto, cpu or cuda, got {preference!r}")
    device = pick_device(preference)
    if device.type == "cuda":
        if triton_available():
            return "cuda", str(device)         # pick_device names it with its index: one applier per GPU
        if preference != "auto":
            raise RuntimeError("CudaMaskApplier needs Triton (shipped with CUDA builds of torch)")
        log.warning("GPU present but Triton does not import: secure aggregation unmasks on the CPU")
    return cpu_mask_expansion_plan()


def cpu_mask_expansion_plan() -> tuple[str, int]:
    """Where masks are expanded without a GPU: ("processes", n) when there are more usable cores
    than the thread path can use, else ("threads", n). Needs no torch, so it can be asked before
    anything touches CUDA (``aggregator serve`` does, to know whether it will fork workers)."""
    cores = usable_cores()
    return ("processes", cores) if cores > MAX_DEFAULT_MASK_WORKERS else ("threads", default_mask_workers())


def pick_mask_applier(preference: str = "auto") -> CudaMaskApplier | ProcessMaskApplier | None:
    """Where the aggregator expands masks, chosen like its other tensor math (compute.pick_device:
    `auto` honours FEDFLEET_DEVICE, `cuda` without a GPU raises): the GPU applier on a CUDA
    device with Triton; on the CPU, worker processes when there are more usable cores than the
    thread path can use, else None -- ServerSecAgg's threaded default. One applier per GPU (or
    process count) is kept for the process, so a kernel compiles and a pool starts once."""
    where, what = mask_expansion_plan(preference)
    if where == "cuda":
        return _applier_for(what)
    return _process_applier(what) if where == "processes" else None


@lru_cache(maxsize=None)
def _applier_for(device: str) -> CudaMaskApplier:
    return CudaMaskApplier(device)


@lru_cache(maxsize=None)
def _process_applier(processes: int) -> ProcessMaskApplier:
    return ProcessMaskApplier(processes).warm_up()
