"""What one Fed3R-Sync member costs in CPU at fleet-10k's shape, and the emulation bound it sets.

A Fed3R-Sync device of fleet-10k (p = 1,281 with the intercept, 10 classes) masks one vector of
m = 833,932 uint64 words (the packed 1,281 x 1,281 triangle, b and n) in a SecAgg+ group of
degree 34 (κ = 1,000). Measured here, each as CPU seconds of this process (time.process_time,
best of --repeats; the machine's other load inflates it less than wall time), one thread:

* the protocol, through ``protocols.secagg.driver`` (every message serialised): one round of
  --n members at degree --degree, consistency check on, nobody dropping out (the fleet runs'
  case), client CPU per member and server CPU per member. A SecAgg+ member's work depends on its
  degree and m, not on n (the consistency check's t signatures are verified once per process);
  the server's per member is one masked input checked and added and one self mask expanded.
* inside it, the steps that grow with m: fixed-point encoding, the 35 mask expansions, the masked
  input's signature (a SHA-256 of the 6.7 MB and one Ed25519), against the floors of the same
  bytes: raw AES-128-CTR keystream (``cryptography``, 35 x m x 8 bytes), the 35 uint64 adds, and
  hashlib's SHA-256;
* what the device does beyond the protocol: its dense statistics (Gram of its rows, the packed
  triangle, the sync vector) against a plain device's factor form, and the wire: the envelope
  (payload SHA-256, signed header, one copy) and its 256 KiB chunks (the whole message's SHA-256,
  each chunk's payload SHA-256 and signature, one more copy), against a plain device's upload;
* what the aggregator does beyond the protocol: reassembling the chunks (each chunk's signature)
  and decoding the whole envelope (its payload SHA-256, which the masked input's signature check
  then reuses instead of hashing again).

The emulation bound (docs/deployment.md, "What the emulation can reach"): a round of κ members
adds at least κ x (the secure member's CPU - a plain member's) of work to the plain round on
the --cores cores that emulate the whole fleet, so the emulated round cannot go under
(plain round + that / cores) / plain round, whatever else gets faster. Left out (so it is a lower
bound): the broker's relaying of 6.7 GB a round, paho's packet handling and the kernel's socket
copies on both sides, the rest of the round's messages on the wire.

    .venv/bin/python bench/fed3r_sync_member.py                      # ~1 min on 2 cores
    .venv/bin/python bench/fed3r_sync_member.py --plain-round-s 7.8 67.2
"""

from __future__ import annotations

import argparse
import hashlib
import os
import sys
import time
from pathlib import Path

# BLAS on one thread, as `fedfleet simulate` runs the device hosts (OMP_NUM_THREADS=1): OpenBLAS's
# idle threads spin, which doubled the CPU of a device's Gram here
os.environ.setdefault("OMP_NUM_THREADS", "1")

import numpy as np  # noqa: E402
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from edge_client.fed3r import Fed3RAccumulator  # noqa: E402
from edge_client.tasks.fed3r_stats import encode_smallest  # noqa: E402
from protocols.chunking import DEFAULT_CHUNK_SIZE, MessageAssembler, encode_parts  # noqa: E402
from protocols.envelope import Envelope, encode as encode_envelope  # noqa: E402
from protocols.identity import DeviceIdentity, IdentityRegistry  # noqa: E402
from protocols.payloads.secagg import from_envelope, pack_sync_vector, sync_vector_length, to_envelope  # noqa: E402
from protocols.secagg import AggregateReady, MaskedInput, RoundConfig  # noqa: E402
from protocols.secagg.crypto import MASK_BLOCK_WORDS, apply_masks  # noqa: E402
from protocols.secagg.driver import WireFrame, make_identities, run_round  # noqa: E402

FEATURES, CLASSES = 1280, 10          # MobileNetV2's features; Fashion-MNIST
P = FEATURES + 1                      # with the intercept
ROWS = 5                              # fleet-10k: 50,000 images over 10,000 devices
# plain Fed3R job time per round at 2,000 devices, κ = 1,000 (docs/deployment.md, same section):
# 15.6 s / 2 rounds with the features cached, and 67.2 s on the idle machine's pipeline pair
PLAIN_ROUND_S = (7.8, 67.2)


def best_cpu(function, repeats: int):
    """(least CPU seconds of ``repeats`` calls, the last call's result)."""
    best, result = float("inf"), None
    for _ in range(repeats):
        started = time.process_time()
        result = function()
        best = min(best, time.process_time() - started)
    return best, result


def protocol_round(n: int, degree: int, m: int, vector: np.ndarray) -> dict:
    """One round through the driver: (client CPU per member, server CPU per member)."""
    identities = {i.device_id: i for i in make_identities(n)}
    config = RoundConfig.create(job_id="bench", round_id=1, group_id="g", aggregator_id="aggregator",
                                members=list(identities), vector_length=m, bound=float(np.abs(vector).max()) + 1,
                                graph="regular", degree=degree, consistency_check=True)
    run = run_round(config, DeviceIdentity.generate("aggregator"), identities, lambda device: vector,
                    server_workers=1)
    if not isinstance(run.outcome, AggregateReady) or len(run.outcome.survivors) != n:
        raise RuntimeError(f"secure round failed: {run.outcome}")
    expected = (config.codec.encode(vector) * np.uint64(n)).astype(np.uint64)
    if not np.array_equal(run.outcome.sum_words, expected):
        raise RuntimeError("the secure sum differs from n x the encoded vector")
    return {"config": config, "client": run.client_seconds / n, "server": run.server_seconds / n,
            "masks": min(config.degree, n - 1) + 1}


def keystream_floor(masks: int, m: int, gcm: bool = False) -> float:
    """CPU seconds of the raw AES-128 keystream of ``masks`` x m words, in the blocks apply_masks
    uses: CTR mode, or (``gcm``) through AES-GCM's loop, as the PRG takes it (the same bits)."""
    chunk = MASK_BLOCK_WORDS * 8
    zeros, out = bytes(chunk), bytearray(chunk + 16)
    started = time.process_time()
    for _ in range(masks):
        mode = modes.GCM(bytes(12)) if gcm else modes.CTR(bytes(16))
        encryptor = Cipher(algorithms.AES(os.urandom(16)), mode).encryptor()
        for start in range(0, m * 8, chunk):
            encryptor.update_into(zeros[: min(chunk, m * 8 - start)], out)
    return time.process_time() - started


def add_floor(masks: int, m: int) -> float:
    """CPU seconds of ``masks`` uint64 adds of m words, block by block as apply_masks adds."""
    target, words = np.zeros(m, np.uint64), np.ones(MASK_BLOCK_WORDS, np.uint64)
    started = time.process_time()
    for _ in range(masks):
        for start in range(0, m, MASK_BLOCK_WORDS):
            chunk = target[start:start + MASK_BLOCK_WORDS]
            np.add(chunk, words[: len(chunk)], out=chunk)
    return time.process_time() - started


def statistics(rng: np.random.Generator, dense: bool):
    """A device's statistics of ROWS samples: the secure device's sync vector (dense) or the plain
    device's factor form (body, tensors)."""
    features, labels = rng.standard_normal((ROWS, FEATURES)), rng.integers(0, CLASSES, ROWS)
    acc = Fed3RAccumulator(CLASSES, FEATURES, True, None, keep_rows=not dense)
    acc.update(features, labels)
    body, tensors = encode_smallest(acc, CLASSES, dense, "float64")
    return pack_sync_vector(tensors["A_upper"], tensors["b"], body["n"]) if dense else (body, tensors)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--n", type=int, default=40, help="group size of the protocol round (per-member cost "
                                                           "depends on the degree, not n)")
    parser.add_argument("--degree", type=int, default=34, help="SecAgg+ graph degree (fleet-10k's κ = 1,000: 34)")
    parser.add_argument("--members", type=int, default=1000, help="members per round (κ) for the bound")
    parser.add_argument("--cores", type=int, default=2, help="cores the emulation runs on, for the bound")
    parser.add_argument("--plain-round-s", type=float, nargs="+", default=PLAIN_ROUND_S,
                        help="plain Fed3R round times to compute the bound for")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args(argv)
    m = sync_vector_length(P, CLASSES)
    rng = np.random.default_rng(0)
    load_before = os.getloadavg()[0]

    # the device's statistics, dense (secure) and factor form (plain)
    dense_s, vector = best_cpu(lambda: statistics(np.random.default_rng(0), dense=True), args.repeats)
    plain_stats_s, (plain_body, plain_tensors) = best_cpu(lambda: statistics(np.random.default_rng(0), dense=False),
                                                          args.repeats)
    vector = vector / np.abs(vector).max()       # any vector of this length: the cost does not depend on it

    rounds = protocol_round(args.n, args.degree, m, vector)
    config, masks = rounds["config"], rounds["masks"]

    # the protocol's steps that grow with m, and their floors on the same bytes
    encode_s, encoded = best_cpu(lambda: config.codec.encode(vector), args.repeats)
    seeds = [(os.urandom(32), 1 if i % 2 else -1) for i in range(masks)]
    masks_s, _ = best_cpu(lambda: apply_masks(encoded.copy(), seeds), args.repeats)
    masked = encoded.copy()
    apply_masks(masked, seeds)
    aes_s = min(keystream_floor(masks, m) for _ in range(args.repeats))
    gcm_s = min(keystream_floor(masks, m, gcm=True) for _ in range(args.repeats))
    add_s = min(add_floor(masks, m) for _ in range(args.repeats))
    sha_s, _ = best_cpu(lambda: hashlib.sha256(masked.view(np.uint8)).digest(), args.repeats)
    identity = DeviceIdentity.generate("device-0")
    message = MaskedInput(job_id="bench", round_id=1, group_id="g", sender=identity.device_id,
                          recipient="aggregator", masked_input=masked)
    sign_s, message = best_cpu(lambda: message.signed(identity), args.repeats)
    wireframe_s, _ = best_cpu(lambda: WireFrame.from_message(message), args.repeats)

    # the device's wire beyond the protocol: envelope and chunks (secure), the result (plain)
    envelope_s, _ = best_cpu(lambda: encode_envelope(to_envelope(message), signer=identity.sign), args.repeats)
    wire_s, parts = best_cpu(lambda: encode_parts(to_envelope(message), identity.sign, DEFAULT_CHUNK_SIZE),
                             args.repeats)
    plain_env = Envelope(type="result", sender=identity.device_id, body=plain_body, tensors=plain_tensors)
    plain_wire_s, plain_parts = best_cpu(lambda: encode_parts(plain_env, identity.sign, DEFAULT_CHUNK_SIZE),
                                         args.repeats)

    # the aggregator's side of the wire: chunks reassembled, the envelope decoded, the message
    registry = IdentityRegistry({identity.device_id: identity.public_key_bytes})

    def receive():
        assembler = MessageAssembler(verifier=registry.verify)
        received = [assembler.feed(part) for part in parts][-1]
        secagg = from_envelope(received)
        secagg.verify(identity.public_key_bytes)      # the payload's hash reused (with_verified_digest)
        return secagg

    receive_s, received = best_cpu(receive, args.repeats)
    plain_receive_s, _ = best_cpu(lambda: [MessageAssembler(verifier=registry.verify).feed(p) for p in plain_parts],
                                  args.repeats)
    if not np.array_equal(received.masked_input, masked):
        raise RuntimeError("the reassembled masked input differs")

    ms = 1e3
    device = rounds["client"] - wireframe_s + wire_s + dense_s       # the driver's frame is the fleet's envelope
    plain_device = plain_stats_s + plain_wire_s
    # in the fleet the aggregator hashes the masked input once, when it decodes the envelope: the
    # driver's server hashes it in the signature check, which the fleet's reuses (so one is taken out)
    server = rounds["server"] - sha_s + receive_s
    extra = device - plain_device + server - plain_receive_s
    print(f"one Fed3R-Sync member at p = {P}, {CLASSES} classes: m = {m:,} words ({m * 8 / 1e6:.2f} MB), "
          f"degree {config.degree} ({masks} mask expansions), protocol round of n = {args.n}; CPU ms, best of "
          f"{args.repeats}; load {load_before:.1f} -> {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs\n")
    rows = [
        ("device: protocol (driver, per member, all phases)", rounds["client"]),
        ("  fixed-point encoding", encode_s),
        (f"  {masks} mask expansions (apply_masks)", masks_s),
        (f"    floor: raw AES-128-CTR of the same {masks} x {m * 8 / 1e6:.2f} MB", aes_s),
        ("    floor: the same keystream through AES-GCM's loop (the PRG's path)", gcm_s),
        (f"    floor: {masks} uint64 adds", add_s),
        ("  masked input signed (SHA-256 + Ed25519)", sign_s),
        ("    floor: one SHA-256 of the 6.7 MB (hashlib)", sha_s),
        ("  the driver's wire frame of it (not in the fleet)", wireframe_s),
        ("device: dense statistics + sync vector", dense_s),
        ("device: envelope only (payload SHA-256, signed header, copy)", envelope_s),
        ("device: envelope + chunks (the upload's wire)", wire_s),
        ("device total (protocol - frame + wire + dense statistics)", device),
        ("plain device: factor-form statistics + its wire", plain_device),
        ("server: protocol (driver, per member)", rounds["server"]),
        ("server: chunks reassembled + envelope decoded + message verified", receive_s),
        ("server total (protocol - one SHA-256 + wire)", server),
        ("plain server: the factor-form result's wire", plain_receive_s),
        ("extra CPU per member, secure - plain (device + server)", extra),
    ]
    for name, seconds in rows:
        print(f"  {name:68} {seconds * ms:9.2f}")
    print(f"\nmask expansion / raw AES-CTR keystream: {masks_s / aes_s:.2f}x; / (AES-GCM keystream + adds): "
          f"{masks_s / (gcm_s + add_s):.2f}x")
    # the device's passes over its upload: the message's signature, the envelope's payload hash,
    # the chunk set's hash, each chunk's payload hash (the aggregator hashes it once)
    hashes = 4 * sha_s
    print(f"the device's 4 SHA-256 passes over its upload: {hashes * ms:.1f} ms, {hashes / device:.0%} of its "
          f"total; the masks {masks_s / device:.0%}, the dense statistics {dense_s / device:.0%}")
    added = args.members * extra
    print(f"\na round of {args.members} members adds {added:.1f} CPU-s, {added / args.cores:.1f} s on {args.cores} cores:")
    # what no wire could take away: the masks at their floor, one SHA-256 on each side, the
    # encoding and the dense statistics
    floor = args.members * (masks_s + 2 * sha_s + encode_s + dense_s)
    for plain in args.plain_round_s:
        print(f"  plain round {plain:6.1f} s -> secure round >= {plain + added / args.cores:6.1f} s: "
              f"bound {(plain + added / args.cores) / plain:.2f}x plain (with only the masks, two SHA-256, "
              f"encoding and statistics: {(plain + floor / args.cores) / plain:.2f}x)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
