"""The Java device's log escaping (org.fedfleet.wire.LogText, driven by tests/java_device/LogTextCases)
against the Python device's (protocols/log_text.py): the same text, the same line.

* which code points are escaped: every one from U+0000 to U+10FFFF, lone surrogates included, the
  same on both sides, except where one side's Unicode database has the code point unassigned (the
  JVM's and Python's Unicode versions differ: a character new in one is ``Cn`` in the other);
* how: hostile strings (newlines before a forged record, ESC and OSC sequences, bidirectional
  overrides and isolates, zero-width and other format characters, line separators, lone
  surrogates, astral characters) and every escaped code point of the sweep, written the same,
  cut the same (``one_line``'s code points, never half an escape), a logger's record and the
  exception it carries made one line alike.

A backslash is escaped by both (``\\\\``), so a sender's printable ``\\n`` never reads as an escaped
newline: in the sweep (U+005C) and in the hostile strings, forged escapes beside real ones; and on
both sides, what any of these strings is shown as, its escapes undone, is the string again.

Before LogText the Java device logged such text raw: no Java side to compare.
"""

from __future__ import annotations

import json
import logging
import subprocess
import unicodedata

import pytest

import java_build
from protocols.log_text import MAX_RECORD_CHARS, OneLineFormatter, escaped_controls, one_line

pytestmark = pytest.mark.skipif(java_build.missing() is not None, reason=str(java_build.missing()))

FORGED = "2026-01-01 00:00:00,000 fedfleet.device WARNING job ops: done"
HOSTILE = [
    "",
    "plain text, nothing to escape: ünïcödé, 中文, \U0001d52a, emoji \U0001f600",
    f"no data\n{FORGED}\r\x1b]0;owned\x07\x1b[2J\u2028\u2029\x85",
    "dev\u202egnp.exe",                                     # RIGHT-TO-LEFT OVERRIDE
    "\u202a\u202b\u202c\u202d\u2066\u2067\u2068\u2069\u200e\u200f\u061c",   # every bidi control
    "zero\u200bwidth\u200c\u200d\u2060\ufeff\u00ad\u180e",  # invisible format characters
    "spaces\u00a0\u3000\u2007 tab\there",
    "lone \ud800 and \udfff surrogates",         # (a pair apart is one character in Java, never from the wire)
    "private \ue000 \U000f0000, unassigned \U000e0080, tag \U000e0041",
    "\x00\x01\x7f\x80\x9f\\x1b already looks escaped",
    "x" * 50 + "\u202e" * 5 + "y" * 50,
    # printable text that reads as an escape (a forged escaped newline, override, ESC) beside the
    # real ones, lone and doubled backslashes, a backslash last (where a cut falls, 52-54 below)
    f"no data\\n{FORGED} \\u202e\u202e \\x1b\x1b \\U0001f600 \\\\n \\",
    "\\",
    "\\\\\\",
    "x" * 50 + "\\" * 5 + "y" * 50,
]
CUTS = (1, 2, 10, 52, 53, 54, 200)                  # around the overrides in the last string too


def cps(text: str) -> list[int]:
    return [ord(c) for c in text]


@pytest.fixture(scope="module")
def java_cp() -> str:
    return java_build.built()


def java(java_cp: str, cases: list[dict]) -> list[dict]:
    lines = [json.dumps(c) for c in cases]
    proc = subprocess.run(java_build.java_command("-cp", java_cp, "LogTextCases"), input="\n".join(lines) + "\n",
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    return [json.loads(line) for line in proc.stdout.splitlines()]


def python_escapes(lo: int, hi: int) -> set[int]:
    return {cp for cp in range(lo, hi) if escaped_controls(chr(cp)) != chr(cp)}


def members(ranges: list) -> set[int]:
    return {cp for start, end in ranges for cp in range(start, end)}


def python_record(text: str) -> tuple[str, str]:
    """The message as the Python device's log writes it, and an exception's line quoting ``text``
    (Java's IllegalStateException's, by Python's rule)."""
    record = logging.LogRecord("x", logging.WARNING, __file__, 1, text, None, None)
    return OneLineFormatter("%(message)s").format(record), one_line(f"java.lang.IllegalStateException: {text}")


@pytest.fixture(scope="module")
def sweep(java_cp) -> dict[str, set[int]]:
    """Every code point, one plane per case: escaped by each side, unassigned in the JVM's Unicode."""
    planes = [(p << 16, (p + 1) << 16) for p in range(17)]
    replies = java(java_cp, [{"op": "sweep", "lo": lo, "hi": hi} for lo, hi in planes])
    return {"java": set().union(*(members(r["escaped"]) for r in replies)),
            "python": set().union(*(python_escapes(lo, hi) for lo, hi in planes)),
            "java_unassigned": set().union(*(members(r["unassigned"]) for r in replies))}


def test_both_devices_escape_the_same_code_points(sweep):
    """A difference only where either side's Unicode has the code point unassigned (the versions
    are a few years apart: a character new in one is Cn, escaped, in the other)."""
    differ = sweep["java"] ^ sweep["python"]
    version_gaps = {cp for cp in differ if unicodedata.category(chr(cp)) == "Cn" or cp in sweep["java_unassigned"]}
    assert differ == version_gaps, [hex(cp) for cp in sorted(differ - version_gaps)[:20]]
    assert len(differ) < 5000, len(differ)
    # the bidi controls, format characters and separators: the same on any version
    assert {0x202A, 0x202E, 0x2066, 0x2069, 0x200B, 0xFEFF, 0x061C, 0x2028, 0x85, 0x1B, 0xD800, 0x5C} <= \
        sweep["java"] & sweep["python"]


def test_both_devices_write_cut_and_log_hostile_text_alike(java_cp, sweep):
    # every escaped control, format character, surrogate and separator, and one in 500 of the private
    # and unassigned code points: written by both, in strings with a printable character between
    # (an escape next to text, not only next to escapes)
    common = sorted(sweep["java"] & sweep["python"])
    swept = [cp for k, cp in enumerate(common) if unicodedata.category(chr(cp)) not in ("Co", "Cn") or k % 500 == 0]
    chunks = ["".join(chr(cp) + "a" for cp in swept[k:k + 250]) for k in range(0, len(swept), 250)]
    texts = HOSTILE + [text * 3 for text in HOSTILE[2:6]] + ["\n" * (MAX_RECORD_CHARS + 10)] + chunks
    cases = [{"op": "text", "cps": cps(t), "max": m} for t in texts for m in (CUTS if t in HOSTILE else (MAX_RECORD_CHARS,))]
    replies = java(java_cp, cases)
    assert len(replies) == len(cases)
    for case, reply in zip(cases, replies):
        text = "".join(map(chr, case["cps"]))
        record, thrown = python_record(text)
        expected = {"escaped": escaped_controls(text), "one_line": one_line(text, case["max"]),
                    "record": record, "thrown": thrown}
        assert reply == expected, repr(text[:80])
        assert "\n" not in reply["record"] and "\x1b" not in reply["record"] and "\u202e" not in reply["record"]


def unescaped(shown: str) -> str:
    """``shown``'s escapes undone by Python's own reading of them (``unicode_escape``; the printable
    non-ASCII characters made escapes first, that codec reads bytes as Latin-1)."""
    return shown.encode("ascii", "backslashreplace").decode("unicode_escape")


def test_what_either_device_shows_reads_back_as_what_was_sent(java_cp):
    """A sender's printable ``\\n`` and a real newline were shown alike (``\\n``, the backslash as
    it came): the log could not say which was sent. Undoing the escapes of what each side shows
    gives back the text sent, whatever it holds, and the forged escapes differ from the real ones."""
    texts = HOSTILE + ["\\n", "\n", "\\u202e", "\u202e", "\\\\x1b", "\\\x1b"]
    replies = java(java_cp, [{"op": "text", "cps": cps(t), "max": MAX_RECORD_CHARS} for t in texts])
    for text, reply in zip(texts, replies):
        assert unescaped(escaped_controls(text)) == text, repr(text)
        assert unescaped(reply["escaped"]) == text, repr(text)
    shown = [escaped_controls(t) for t in texts[-6:]]
    assert len(set(shown)) == 6, shown
