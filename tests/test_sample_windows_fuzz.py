"""Random sequences of Fed3R windows through the sample-window ledger (``edge_client/sample_windows.py``,
``SampleWindows.java``), checked against what its docstring promises, not against its rule:

* **Privacy.** The windows a device answered, as 0/1 vectors over its samples: every nonzero sum or
  difference (coefficients -1, 0, 1) of up to ``MOST_COMBINED`` of them covers at least
  ``MIN_DIFFERENCE`` samples, brute force. The one exception the docstring grants is the device's
  first answer when it starts at sample 0 (asked of a fresh ledger, whatever its size): a combination
  that is a multiple of that answer (``[0, 3)`` itself; ``[0, 3) + [0, 20) - [3, 20)`` is twice it)
  shows only what that answer showed. Nothing else is exempt.
* **What is answered.** A re-run of a window answered is answered (with a state folder); a fresh
  device's first window from sample 0 is answered (without one: when it is all the samples).
* **Restarts.** The same sequence with the device restarted (a fresh ledger on its file) at random
  points decides every window alike, word for word, and leaves the same file, which holds exactly 0
  and the ends of the windows answered.
* **Java.** ``SampleWindows.java`` (TaskRunner ``--windows``, this worker's one served JVM for all
  sequences), restarted at the same points, decides each step as the Python ledger that never
  restarted does, word for word, and leaves the same file.

A sequence is a device of up to ``N_MOST`` samples whose data grows, asked windows [s, e) of them as
a Fed3R task would ask (from_sample s; e its count, or s + max_samples under a cap): windows anywhere,
from sample 0, re-runs of answered ones, answered ones with an end moved by a sample or a few, and
streaming increments from the last end answered; with a state folder, or without one (no restarts
there: nothing outlives one, by design). The steps are drawn from hypothesis's ``randoms`` as the
sequence goes (which windows were answered decides what a re-run asks), derandomized: the same
examples every run; a failure names its shrunk sequence by its concrete steps."""

from __future__ import annotations

import functools
import itertools
import json
import tempfile
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from edge_client.sample_windows import MIN_DIFFERENCE, WINDOWS_FILE, SampleWindowLedger
from test_sample_windows_closed import python_windows_script

N_MOST = 40
MOST_COMBINED = 3
FUZZ = settings(max_examples=200, derandomize=True, deadline=None, database=None,
                suppress_health_check=list(HealthCheck))
# each answer writes and fsyncs the ledger: in memory where there is a tmpfs (as test_differential_fuzz's folder)
SCRATCH = "/dev/shm" if Path("/dev/shm").is_dir() else None

# how often a sequence's step is each kind, and how far "moved" and "between" move an end
STEPS = {"grow": 3, "anywhere": 2, "streaming": 1, "from zero": 2, "between": 4, "re-run": 2, "moved": 3,
         "increment": 2, "restart": 2}
MOVES = (-9, -8, -7, -2, -1, 1, 2, 7, 8, 9)
OFFSETS = (0, 0, -1, 1, 3, 8, 9, 10, 16)
# samples at first, a state folder? (mostly: without one only windows of all the samples are answered),
# how many steps, and the draws that choose them (hypothesis's: derandomized and shrunk)
SEQUENCES = st.tuples(st.integers(1, N_MOST), st.sampled_from((True, True, True, False)), st.integers(4, 20),
                      st.randoms(use_true_random=False))


def next_window(kind: str, rng, n: int, answered: list[tuple[int, int]]) -> tuple[int, int] | None:
    """The window [s, e) (0 <= s < e <= n, as a task can ask) a step of ``kind`` asks of a device of n
    samples that answered ``answered``, or None (that step asks nothing)."""
    if kind == "anywhere":                   # from_sample s, max_samples under a cap
        start = rng.randrange(n)
        return start, rng.randint(start + 1, n)
    if kind == "streaming":
        return rng.randrange(n), n
    if kind == "from zero":                  # a cap from the first sample (DP)
        return 0, rng.randint(1, n)
    if kind == "between":                    # from one end answered (or 0) to another (or n), the second moved
        ends = sorted({0, n, *itertools.chain.from_iterable(answered)})
        start = rng.choice(ends)
        window = start, rng.choice([e for e in ends if e > start] or [n]) + rng.choice(OFFSETS)
    elif not answered:
        return None
    elif kind == "re-run":
        return rng.choice(answered)
    elif kind == "moved":                    # an answered window, one end a sample or a few off
        start, end = rng.choice(answered)
        move = rng.choice(MOVES)
        window = (start + move, end) if rng.random() < 0.5 else (start, end + move)
    elif kind == "increment":                # streaming from the last end answered
        window = max(end for _, end in answered), n
    else:
        raise AssertionError(kind)
    return window if 0 <= window[0] < window[1] <= n else None


class Run:
    """One sequence through a Python ledger that is never restarted (the reference): the concrete
    steps (TaskRunner --windows syntax, "restart" among them) and what the ledger said at each."""

    def __init__(self, sequence, folder: Path | None):
        n, keeps_state, count, rng = sequence
        self.kept = keeps_state
        self.path = folder / "reference" / WINDOWS_FILE if keeps_state else None
        if self.path is not None:
            self.path.parent.mkdir()
        ledger = SampleWindowLedger(self.path)
        self.steps: list[str] = []
        self.said: list[str] = []
        self.asked: list[tuple[int, int, int]] = []
        self.answered: list[tuple[int, int]] = []
        for kind in rng.choices(list(STEPS), weights=list(STEPS.values()), k=count):
            if kind == "grow":
                n = min(N_MOST, n + rng.randint(1, 12))
            elif kind == "restart":
                if keeps_state:            # without a state folder nothing outlives a restart, by design
                    self.steps.append("restart")
            elif (window := next_window(kind, rng, n, self.answered)) is not None:
                reason = ledger.record(*window, n)
                self.steps.append(f"record:{window[0]}:{window[1]}:{n}")
                self.said.append("OK" if reason is None else reason)
                self.asked.append((*window, n))
                if reason is None:
                    self.answered.append(window)

    def file_text(self) -> str | None:
        return self.path.read_text() if self.path is not None and self.path.exists() else None


@functools.lru_cache(maxsize=None)
def coefficients(m: int) -> np.ndarray:
    """Every vector of m coefficients in {-1, 0, 1} with 1 to MOST_COMBINED of them nonzero."""
    rows = []
    for k in range(1, min(m, MOST_COMBINED) + 1):
        for chosen in itertools.combinations(range(m), k):
            for signs in itertools.product((-1, 1), repeat=k):
                row = np.zeros(m, dtype=np.int64)
                row[list(chosen)] = signs
                rows.append(row)
    return np.array(rows, dtype=np.int64).reshape(-1, m)


def isolating_combination(answered: list[tuple[int, int]], exempt: tuple[int, int] | None):
    """A combination of answered windows (coefficients, windows) that covers fewer than MIN_DIFFERENCE
    samples and is no multiple of the exempt first answer; None when there is none."""
    windows = sorted(set(answered))
    if not windows:
        return None
    samples = np.arange(N_MOST)
    vectors = np.array([(s <= samples) & (samples < e) for s, e in windows], dtype=np.int64)
    coef = coefficients(len(windows))
    combined = coef @ vectors
    support = np.count_nonzero(combined, axis=1)
    small = (support > 0) & (support < MIN_DIFFERENCE)
    if exempt is not None:
        inside = (exempt[0] <= samples) & (samples < exempt[1])
        first = combined[:, exempt[0]]
        multiple = (combined[:, ~inside] == 0).all(axis=1) & (combined[:, inside] == first[:, None]).all(axis=1)
        small &= ~multiple
    if not small.any():
        return None
    row = coef[np.flatnonzero(small)[0]]
    return [(int(c), windows[i]) for i, c in enumerate(row) if c]


def check_privacy_and_promises(run: Run) -> None:
    first = run.answered[0] if run.answered else None
    exempt = first if first is not None and first[0] == 0 else None
    found = isolating_combination(run.answered, exempt)
    assert found is None, f"answers {run.answered} combine to {found}: fewer than {MIN_DIFFERENCE} samples; {run.steps}"
    seen: set[tuple[int, int]] = set()
    for (start, end, n), said in zip(run.asked, run.said):
        if run.kept and (start, end) in seen:
            assert said == "OK", f"a re-run of the answered [{start}, {end}) declined: {said}"
        if not seen and start == 0 and (run.kept or end == n):
            assert said == "OK", f"a fresh device's first window [0, {end}) of {n} declined: {said}"
        if said == "OK":
            seen.add((start, end))


def expected_file(run: Run) -> str | None:
    """What the docstring says the file holds: 0 and both ends of every window answered, ascending
    (no file before a first answer)."""
    if not run.kept or not run.answered:
        return None
    ends = sorted({0, *itertools.chain.from_iterable(run.answered)})
    return json.dumps({"boundaries": ends}, separators=(",", ":"))


@given(SEQUENCES)
@FUZZ
def test_no_combination_of_answers_isolates_a_few_samples_and_restarts_change_nothing(sequence):
    with tempfile.TemporaryDirectory(prefix="windows-fuzz-", dir=SCRATCH) as folder:
        run = Run(sequence, Path(folder))
        check_privacy_and_promises(run)
        assert run.file_text() == expected_file(run)
        if run.kept:
            restarted = Path(folder) / "restarted" / WINDOWS_FILE
            restarted.parent.mkdir()
            assert python_windows_script(restarted, run.steps) == run.said
            assert (restarted.read_text() if restarted.exists() else None) == run.file_text()


def test_the_oracle_finds_the_docstrings_attack_and_grants_only_the_first_answer():
    """The oracle itself, on windows no ledger was asked: the docstring's [0, 10), [10, 20), [0, 21)
    isolate sample 20; a first answer [0, 3) is exempt, alone and doubled, a later one is not."""
    assert isolating_combination([(0, 10), (10, 20), (0, 21)], (0, 10)) == [(-1, (0, 10)), (1, (0, 21)), (-1, (10, 20))]
    assert isolating_combination([(0, 10), (10, 20), (0, 30)], (0, 10)) is None
    assert isolating_combination([(0, 3), (0, 20), (3, 20)], (0, 3)) is None
    assert isolating_combination([(0, 3), (0, 20), (3, 20)], None) == [(-1, (0, 3))]
    assert isolating_combination([(0, 3), (0, 20), (3, 21)], (0, 3)) == [(-1, (0, 20)), (1, (3, 21))]
    assert isolating_combination([(8, 20), (8, 23)], None) == [(-1, (8, 20)), (1, (8, 23))]


def test_the_java_ledger_decides_every_sequence_alike():
    """Each sequence, restarts included, through SampleWindows in the served TaskRunner JVM: the same
    words at every step and the same file; and the sequences do reach the rule (answers past a
    device's first, declines)."""
    import java_build
    from java_tasks import java

    if java_build.missing() is not None:
        pytest.skip(java_build.missing())
    cp = java_build.built()
    compared = []

    @given(SEQUENCES)
    @FUZZ
    def alike(sequence):
        with tempfile.TemporaryDirectory(prefix="windows-fuzz-", dir=SCRATCH) as folder:
            run = Run(sequence, Path(folder))
            if not run.steps:
                return
            java_file = Path(folder) / "java" / WINDOWS_FILE
            java_file.parent.mkdir()
            said = java(cp, "--windows", java_file if run.kept else "-", *run.steps).splitlines()
            assert said == run.said, run.steps
            assert (java_file.read_text() if java_file.exists() else None) == run.file_text(), run.steps
            compared.append(run)

    alike()
    assert sum(len(set(r.answered)) >= 3 for r in compared) >= 10
    assert sum(said != "OK" for r in compared for said in r.said) >= 50
