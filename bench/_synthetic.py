"""Shared bench helpers: synthetic Fed3R devices (real agents, no backbone) and a private broker."""

from __future__ import annotations

import threading

import numpy as np

from edge_client.fed3r import Fed3RAccumulator
from protocols.payloads.fed3r import encode_stats


class PrecomputedStats:
    """A fed3r.stats task handler that returns statistics computed once, ahead of time."""

    def __init__(self, d: int, num_classes: int, n: int = 64, seed: int = 0):
        rng = np.random.default_rng(seed)
        acc = Fed3RAccumulator(num_classes, d)
        acc.update(rng.normal(size=(n, d)).astype(np.float32), rng.integers(0, num_classes, n))
        A, ids, b = acc.sparse()
        self.result = encode_stats(A, ids, b, acc.n, num_classes)

    def __call__(self, params, tensors=None):
        return self.result


def run_in_thread(fn):
    out = {}
    t = threading.Thread(target=lambda: out.update(fn()), daemon=True)
    t.start()
    return t, out
