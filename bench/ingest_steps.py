"""Per-step costs of ingesting one large Fed3R result, each against what it replaced, in one run.

1. header validation of a 6.6 MB upload's 26 chunk headers: jsonschema-rs (now) vs
   python-jsonschema (before), the same headers;
2. the Gram check of a packed 1281 x 1281 A: float32 Cholesky of the unit-diagonal matrix
   (``check_gram`` now) vs one float64 Cholesky of A + τI (before), on one thread;
3. reassembling and decoding the upload: a MessageAssembler (one sha256 pass, at the whole
   message's decode) vs each chunk decoded in full, the whole hashed by the Reassembler and
   decoded in full again (three passes, before);
4. the Gram check's factorisation alone (float32, 1281 x 1281): LAPACK's potrf through scipy, in
   place on the transposed view (``aggregator.compute.device.cholesky_in_place``, now) vs torch's
   ``cholesky_ex`` (before);
5. the ridge solve of the summed statistics (float64, C = 10 classes): ``ClosedFormRidge`` on
   the CPU (LAPACK, now) vs the same with torch's Cholesky and ``cholesky_solve`` (before);
6. handing the upload to an ingest worker process and back, the worker hashing every byte as its
   decode does: through a reused shared memory segment (``aggregator.service.ingest.TransferBuffers``,
   now) vs pickled through the process pool's pipe (before);
7. the finished job's canonical re-sum (``partial_sums.canonical_sum``) of ``--resum`` such uploads
   kept in memory, per upload: bucket sums carrying A's packed triangle (``Fed3R.sums_state``, now)
   vs a dense symmetrised A per bucket, added up the tree and gathered back (before); the same bits.
8. an ingest worker's validation of the decoded upload (finiteness, the Gram check): a reused
   float32 scratch matrix filled from the packed triangle, views on the upload (``check_gram``,
   ``parse_stats`` now) vs a copy of the upload, a fresh dense float64 matrix and its float32 copy
   (before). In this loop glibc hands the freed arrays back untouched; in a worker process the
   kernel also zeroed their pages (``perf``: ``clear_page_erms`` under the copies), which
   ``bench/fed3r_ingest.py`` sees and this loop does not.
9. receiving a Fed3R-Sync masked input (the same number of uint64 words as the upload's floats,
   a signed SecAgg message in a signed envelope): decode, then the SecAgg signature check, which
   reuses the digest decode took of the very same bytes (``Envelope.verified_payload``, now) vs
   hashing the array again (before);
10. encoding that envelope on the device: each tensor hashed in place and copied once into the
   message (now) vs ``tobytes`` and a join, two copies (before); the same bytes.

Prints milliseconds per upload and the ratio before / now for each step.

    .venv/bin/python bench/ingest_steps.py [--d 1280] [--repeats 5] [--resum 20]
"""

from __future__ import annotations

import argparse
import hashlib
import multiprocessing
import struct
import sys
import time
from multiprocessing.shared_memory import SharedMemory
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from threadpoolctl import threadpool_limits  # noqa: E402

from aggregator.compute.device import cholesky_in_place  # noqa: E402
from aggregator.jobs.registry import build_job  # noqa: E402
from aggregator.shards.fed3r_sums import Fed3RSums  # noqa: E402
from aggregator.shards.partial_sums import by_bucket, canonical_sum, job_of_root  # noqa: E402
from aggregator.shards.sum_tree import PartialSum, lazy_root  # noqa: E402
from aggregator.service.ingest import TransferBuffers  # noqa: E402
from aggregator.compute.ridge import ClosedFormRidge  # noqa: E402
from aggregator.strategies.fed3r import Fed3R  # noqa: E402
from protocols.chunking import MessageAssembler, Reassembler, split  # noqa: E402
from protocols.envelope import (MAGIC, PREFIX_LEN, Envelope, _fast_is_valid, _validator,  # noqa: E402
                                canonical_json, decode, encode, parse_strict_json, require_finite)
from protocols.identity import DeviceIdentity, IdentityRegistry  # noqa: E402
from protocols.payloads.secagg import from_envelope, to_envelope  # noqa: E402
from protocols.secagg.messages import MaskedInput  # noqa: E402
from protocols.payloads.fed3r import check_gram, encode_stats, triu_fill  # noqa: E402

C = 10


def seconds(fn, repeats: int) -> float:
    fn()
    t0 = time.perf_counter()
    for _ in range(repeats):
        fn()
    return (time.perf_counter() - t0) / repeats


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--d", type=int, default=1280)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--resum", type=int, default=20, help="uploads in the canonical re-sum (step 7)")
    args = ap.parse_args()
    torch.set_num_threads(1)
    threadpool_limits(1)                # LAPACK through scipy and numpy: one thread, as torch
    p, rng = args.d + 1, np.random.default_rng(0)
    Z = np.hstack([rng.normal(size=(64, args.d)), np.ones((64, 1))])
    y = rng.integers(0, C, 64)
    ids = np.unique(y)
    body, tensors = encode_stats(Z.T @ Z, ids, np.stack([Z[y == c].sum(0) for c in ids]), 64, C)
    whole = encode(Envelope(type="result", sender="dev0001", body=body, tensors=tensors))
    chunks = split(whole, decode(whole).id, "dev0001")
    headers = [parse_strict_json(c[PREFIX_LEN:PREFIX_LEN + int.from_bytes(c[4:8], "little")]) for c in chunks]
    print(f"d={args.d}: one upload of {len(whole) / 1e6:.2f} MB in {len(chunks)} chunks")

    rows = []
    fast, reference = _fast_is_valid(), _validator()
    rows.append(("chunk header validation", seconds(lambda: [reference.is_valid(h) for h in headers], args.repeats),
                 seconds(lambda: [fast(h) for h in headers], args.repeats)))

    a_upper = decode(whole).tensors["A_upper"]
    strategy = Fed3R(C, p, 0.01)
    eps = float(np.finfo(np.float64).eps)

    def float64_check():
        full = triu_fill(a_upper, p)
        tau = 4 * p * eps * float(full.diagonal().max())
        assert strategy.positive_definite(full, tau)

    rows.append(("Gram check", seconds(float64_check, args.repeats),
                 seconds(lambda: check_gram(a_upper, p, eps, strategy.positive_definite), args.repeats)))

    def three_passes():
        r = Reassembler()
        for c in chunks:
            got = r.add(decode(c), now=0.0)
        decode(got)

    def assembler():
        asm = MessageAssembler()
        for c in chunks:
            got = asm.feed_lazy(c, now=0.0)
        decode(got[1])

    rows.append(("reassemble + decode", seconds(three_passes, args.repeats), seconds(assembler, args.repeats)))

    unit = triu_fill(a_upper, p).astype(np.float32)
    unit /= np.sqrt(np.outer(unit.diagonal(), unit.diagonal())) + np.float32(1e-30)
    tau = 4 * p * float(np.finfo(np.float32).eps)

    def torch_factor():
        t = torch.from_numpy(unit.copy())
        t.diagonal().add_(tau)
        assert int(torch.linalg.cholesky_ex(t, upper=True)[1]) == 0

    rows.append(("Gram factorisation", seconds(torch_factor, args.repeats),
                 seconds(lambda: cholesky_in_place(unit.copy(), tau)[1] or _fail(), args.repeats)))

    A, B = torch.from_numpy(triu_fill(a_upper, p)), torch.from_numpy(rng.normal(size=(p, C)))

    def torch_solve():
        reg = A.clone()
        reg.diagonal().add_(0.01)
        torch.cholesky_solve(B, torch.linalg.cholesky_ex(reg, upper=True)[0], upper=True)

    rows.append(("ridge solve", seconds(torch_solve, args.repeats),
                 seconds(lambda: ClosedFormRidge(0.01, device="cpu").fit_statistics(A, B, upper=True), args.repeats)))
    rows.append(handoff_row(whole, args.repeats))
    rows.append(resum_row(decode(whole), args.d, args.resum, args.repeats))
    rows.append(worker_check_row(whole, p, strategy.positive_definite, args.repeats))
    rows.extend(masked_input_rows(a_upper.size, args.repeats))
    print(f"{'step':<26}{'before ms':>11}{'now ms':>9}{'before/now':>12}")
    for name, before, now in rows:
        print(f"{name:<26}{before * 1e3:>11.2f}{now * 1e3:>9.2f}{before / now:>12.1f}")


def worker_check_row(whole: bytes, p: int, positive_definite, repeats: int) -> tuple[str, float, float]:
    """Step 8: what a worker runs on a decoded upload after its sha256, now and before."""
    msg = decode(whole)
    eps = float(np.finfo(np.float64).eps)

    def before():
        require_finite(msg, "A_upper", "b")
        a = np.array(msg.tensors["A_upper"], dtype=np.float64)              # the upload's copy
        full = triu_fill(a, p)                                               # a fresh dense float64 matrix
        diag = full.diagonal().copy()
        inv_sqrt = (1.0 / np.sqrt(np.where(diag == 0, 1.0, diag))).astype(np.float32)
        unit = full.astype(np.float32)                                       # and its float32 copy
        unit *= inv_sqrt[:, None]
        unit *= inv_sqrt[None, :]
        assert positive_definite(unit, 4 * p * float(np.finfo(np.float32).eps))

    def now():
        require_finite(msg, "A_upper", "b")
        check_gram(np.asarray(msg.tensors["A_upper"], dtype=np.float64), p, eps, positive_definite)

    return "worker validation", seconds(before, repeats), seconds(now, repeats)


def masked_input_rows(words: int, repeats: int) -> list[tuple[str, float, float]]:
    """Steps 9 and 10: a masked input of ``words`` ring words, received and encoded."""
    device = DeviceIdentity.generate("dev0001")
    masked = np.random.default_rng(1).integers(0, 2**63, words, dtype=np.uint64)
    msg = MaskedInput(job_id="j", round_id=1, group_id="g", sender="dev0001", recipient="aggregator",
                      masked_input=masked).signed(device)
    env = to_envelope(msg)
    data = encode(env, signer=device.sign)
    verifier = IdentityRegistry({"dev0001": device.public_key_bytes}).verify

    def receive(reuse_digest: bool):
        back = from_envelope(decode(data, verifier))
        if not reuse_digest:
            back.verified_digests.clear()
        back.verify(device.public_key_bytes)

    def encode_two_copies():               # the encoder as it was: tobytes, then a join
        blob = np.ascontiguousarray(masked).tobytes()
        header = env.header_fields()
        header["tensors"] = [{"name": "masked_input", "dtype": "uint64", "shape": [words], "offset": 0,
                              "nbytes": len(blob)}]
        header["payload_sha256"] = hashlib.sha256(b"".join([blob])).hexdigest()
        header["sig"] = device.sign(canonical_json(header)).hex()
        hbytes = canonical_json(header)
        return MAGIC + struct.pack("<I", len(hbytes)) + hbytes + blob

    if encode_two_copies() != data:
        raise SystemExit("the encoder's bytes differ from the two-copy encoder's")
    return [("masked input receipt", seconds(lambda: receive(False), repeats), seconds(lambda: receive(True), repeats)),
            ("masked input encode", seconds(encode_two_copies, repeats),
             seconds(lambda: encode(env, signer=device.sign), repeats))]


class DenseFed3RSums(Fed3RSums):
    """The bucket sums as they were: each bucket's job's ``state_dict`` (a dense, symmetrised A)."""

    def sum_bucket(self, new_job, members, context):
        job = new_job()
        for device, _round, load in members:
            job.apply(device, load(job))
        return PartialSum(job.state_dict(), dict(job.contributed))


def resum_row(result: Envelope, d: int, uploads: int, repeats: int) -> tuple[str, float, float]:
    """Seconds per upload of the canonical re-sum of ``uploads`` kept results (distinct devices, so
    distinct buckets, the same statistics), dense partial states against packed ones."""
    config = {"num_classes": C, "feature_dim": d}
    stats = build_job("fed3r", config).parse_result(result)
    kept = [(f"dev{i:04d}", 1, lambda _job: stats) for i in range(uploads)]
    members, roots = by_bucket(kept), {}

    def resum(adder) -> None:          # partial_sums.canonical_sum, with this adder
        def new_job():
            return build_job("fed3r", config)
        root = lazy_root(adder, lambda b: adder.sum_bucket(new_job, members[b], None) if b in members else None)
        roots[type(adder)] = job_of_root("fed3r", config, root).strategy.packed_upper()
    before, now = seconds(lambda: resum(DenseFed3RSums()), repeats), seconds(lambda: resum(Fed3RSums()), repeats)
    packed = canonical_sum("fed3r", config, kept).strategy.packed_upper()       # the product's own path
    if not (np.array_equal(roots[DenseFed3RSums], roots[Fed3RSums]) and np.array_equal(packed, roots[Fed3RSums])):
        raise SystemExit("the packed re-sum differs from the dense one")
    return f"re-sum ({uploads} kept)", before / uploads, now / uploads


def _hash_bytes(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _hash_shared(name: str, length: int) -> str:
    segment = SharedMemory(name=name)
    try:
        with segment.buf[:length] as data:
            return hashlib.sha256(data).hexdigest()
    finally:
        segment.close()


def handoff_row(whole: bytes, repeats: int) -> tuple[str, float, float]:
    buffers, pool = TransferBuffers(keep=2), multiprocessing.get_context("spawn").Pool(1)
    want = hashlib.sha256(whole).hexdigest()

    def pipe():
        assert pool.apply(_hash_bytes, (whole,)) == want

    def shared():
        segment = buffers.put(whole)
        try:
            assert pool.apply(_hash_shared, (segment.name, len(whole))) == want
        finally:
            buffers.release(segment)

    try:
        return "hand-off to a worker", seconds(pipe, repeats), seconds(shared, repeats)
    finally:
        pool.terminate()
        buffers.close()


def _fail():
    raise AssertionError("the factorisation failed")


if __name__ == "__main__":
    main()
