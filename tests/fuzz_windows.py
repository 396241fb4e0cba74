"""The sample windows of the differential fuzzer's ``fed3r.stats`` cases (tests/test_differential_fuzz.py):
a task's ``from_sample`` (streaming: the samples the aggregator holds already) and ``max_samples``
with ``cap_samples`` (the first ones only) choose which of a device's samples it covers, through the
device's sample-window ledger (edge_client/sample_windows.py, SampleWindows.java). Every device of
the fuzzer is a fresh one with a kept ledger per case (``fuzz_device.fresh_windows``, TaskRunner's
freshWindows), so these windows are computed and compared, not declined by all alike.

``draw``: a case's window params, valid ones the ledger answers on a fresh device (a cap from the
first sample, whatever its size; a streaming window whose ends lie ``MIN_DIFFERENCE`` or more from
0 and from each other) on enough rows for them, and values to decline: from_sample beyond the
samples, at them (no new samples), too near 0 or the end for the ledger, negative, past the
protocol's counts, not an integer; max_samples 0 or not an integer, cap_samples without it or not
a bool. ``expected_window``: the [start, end) a case's answer must cover (numpy's slice, not the
devices' code), which ``check_answer`` holds each device's answered count and classes to;
``window_tags``: whether an answered case was capped or streaming (the fuzzer counts those).
"""

from __future__ import annotations

import numpy as np

from edge_client.sample_windows import MIN_DIFFERENCE

WINDOWED = 0.45          # the share of cases with window params
BAD_FROM_SAMPLE = (-1, -2**31, 2**31, 2**63 - 1, 2**64, 8.0, 1.5, "8", True, [8])
BAD_CAP = ({"max_samples": 0, "cap_samples": True}, {"cap_samples": True}, {"max_samples": 3.0, "cap_samples": True},
           {"max_samples": "3", "cap_samples": True}, {"max_samples": True, "cap_samples": True},
           {"max_samples": 3, "cap_samples": 1}, {"max_samples": 3, "cap_samples": "true"})


def fed3r_stats_case(rng):
    """The fuzzer's fed3r.stats case: its ``fed3r_case``, some with window params (``draw``), on
    more rows where a streaming window needs them."""
    from test_differential_fuzz import fed3r_case, features      # the fuzzer's module (it imports this one)

    params, tensors, (Z, y), _ = fed3r_case(rng)
    window, rows = draw(rng, len(y))
    if rows != len(y):
        Z, y = features(rng, rows, Z.shape[1], params["num_classes"])
    return {**params, **window}, tensors, (Z, y), None


def draw(rng, n: int) -> tuple[dict, int]:
    """The window params of a case of ``n`` rows (none in 1 - WINDOWED), and its rows: more for a
    streaming window, whose ends the ledger answers only ``MIN_DIFFERENCE`` apart."""
    if rng.random() >= WINDOWED:
        return {}, n
    params, start = {}, 0
    if rng.random() < 0.5:                              # streaming
        start = int(rng.integers(MIN_DIFFERENCE, 2 * MIN_DIFFERENCE))
        n = start + int(rng.integers(MIN_DIFFERENCE + 1, 2 * MIN_DIFFERENCE + 2))
        if rng.random() < 0.3:                          # declined: past, at, too near the first sample or the end
            start = int(rng.choice([n + int(rng.integers(1, 4)), n, int(rng.integers(1, MIN_DIFFERENCE)),
                                    n - int(rng.integers(1, MIN_DIFFERENCE))]))
        params["from_sample"] = start
        if rng.random() < 0.1:                          # refused by the params' checks
            params["from_sample"] = BAD_FROM_SAMPLE[int(rng.integers(0, len(BAD_FROM_SAMPLE)))]
    if not params or rng.random() < 0.6:
        new = n - min(start, n)
        low = 1 if start == 0 else MIN_DIFFERENCE       # a capped streaming window's end, too, MIN_DIFFERENCE away
        cap = int(rng.integers(low, new)) if rng.random() < 0.8 and low < new else int(rng.integers(1, new + 3))
        params.update(max_samples=cap, cap_samples=bool(rng.random() < 0.9))
        if rng.random() < 0.1:
            params.pop("max_samples" if rng.random() < 0.5 else "cap_samples")   # no cap (or refused)
        elif rng.random() < 0.1:
            params = {**params, **BAD_CAP[int(rng.integers(0, len(BAD_CAP)))]}
    return params, n


def expected_window(params: dict, n: int) -> tuple[int, int]:
    """The samples [start, end) a task of these (valid) params covers on a device of ``n`` samples."""
    start = params.get("from_sample") or 0
    cap = params["max_samples"] if params.get("cap_samples") is True else n
    return start, min(n, start + cap)


def window_tags(params: dict, n: int) -> tuple[str, ...]:
    """What a case's (valid) window params make of it: "capped" (the cap below the samples after
    from_sample), "streaming" (from_sample > 0); none, or neither."""
    start, end = expected_window(params, n)
    return (("capped",) if end < n else ()) + (("streaming",) if start > 0 else ())


def check_answer(case: tuple, stats) -> list[tuple]:
    """An answered case's parsed statistics (protocols.payloads.fed3r.parse_stats) cover its window:
    the count is the window's, and (sparse b) its classes those present in the window."""
    params, _, (_, y), _ = case
    start, end = expected_window(params, len(y))
    failures = []
    if stats.n != end - start:
        failures.append(("window", "count", stats.n, (start, end)))
    present = np.unique(y[start:end])
    if params["format"] == "sparse" and not np.array_equal(np.sort(stats.class_ids), present):
        failures.append(("window", "classes", stats.class_ids.tolist(), present.tolist()))
    return failures
