"""The Java device reads message bodies and settings as the Python device does, on the edge cases a
differential review found (docs/protocol.md "Model rollout", "Job ended", docs/secure-aggregation.md,
"Transport"): the same input goes through the Java device's parser (tests/java_device/BodyEdges:
ModelSlot.assignment, JobEnded.parse, RoundConfig.fromMap, new Topics) and through the Python
device's (protocols.payloads.deployment.parse_assignment, job_end.parse_job_ended,
protocols.secagg.config.RoundConfig.from_dict, protocols.topics.Topics), and both must accept it
and read the same values, or both refuse it.

What differed before:
* a deployment id or sha256 with a trailing newline (``"dep-1\\n"``) was taken by the Python
  parser, whose ``^…$`` patterns ran under ``re.match`` (``$`` also matches before a final
  newline); the same for an artifact's name and an ``artifact.get``'s sha256;
* a ``run`` assignment's ``bundle_sha256`` of ``null``, ``false`` or ``0`` read as "" by Python,
  refused by Java; a ``model_id`` missing or not an integer refused by Python, taken by Java;
* text limits in characters (job ids, member ids: Python's ``len``, Unicode code points) counted in
  UTF-16 units by Java, which refused an id of 65 to 128 astral-plane characters;
* a topic root with a control character or over 128 characters taken by the Java device;
* a ``run``'s ``nbytes`` of 2^63 to 2^64 - 1 (JSON integers the wire takes) read by the Java device
  with ``BigInteger.longValue()``, which wrapped it to a negative count: refused, but as "head of -1
  bytes", not with the number it was sent and the limit, as the Python device says it.
"""

from __future__ import annotations

import hashlib
import json
import subprocess

import numpy as np
import pytest

import java_build
from protocols.envelope import Envelope, EnvelopeError, decode, encode
from protocols.payloads import deployment as D
from protocols.payloads.artifacts import ArtifactDigestMismatch, check_sha, parse_artifact
from protocols.payloads.job_end import JobEnded, job_ended_message, parse_job_ended
from protocols.secagg.config import RoundConfig
from protocols.secagg.errors import ConfigError
from protocols.topics import Topics

pytestmark = pytest.mark.skipif(java_build.missing() is not None, reason=str(java_build.missing()))

SHA = "ab" * 32
ASTRAL = "\U0001d52a"           # MATHEMATICAL FRAKTUR SMALL M: one character, two UTF-16 units


@pytest.fixture(scope="module")
def java_cp() -> str:
    return java_build.built()


def java_decisions(java_cp: str, cases: list[dict]) -> list[str]:
    """Each case's decision by the Java device (one JVM for all cases)."""
    lines = [json.dumps(c, ensure_ascii=True) for c in cases]
    proc = subprocess.run(java_build.java_command("-cp", java_cp, "BodyEdges"), input="\n".join(lines) + "\n",
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    return [json.loads(line)["out"] for line in proc.stdout.splitlines()]


def python_decision(case: dict) -> str:
    """The Python device's decision on the case: ACCEPT and what it read (as JSON), or REFUSE."""
    try:
        if case["op"] == "assignment":
            a = D.parse_assignment(decode(bytes.fromhex(case["hex"])))
            keys = ["deployment", "device", "seq", "action"] + (["sha256", "nbytes", "bundle_sha256"]
                                                                 if a["action"] == D.RUN else ["reason"])
            read = {k: a[k] for k in keys}
        elif case["op"] == "artifact":
            try:
                _, data = parse_artifact(decode(bytes.fromhex(case["hex"])), case["sha256"])
            except EnvelopeError as exc:        # its refusal class, as edge_client/deployment.py reports it
                return f"REFUSE {'hash' if isinstance(exc, ArtifactDigestMismatch) else 'load'} {exc}"
            read = hashlib.sha256(data).hexdigest()
        elif case["op"] == "job.ended":
            read = [n.job for n in parse_job_ended(decode(bytes.fromhex(case["hex"])))]
        elif case["op"] == "round_config":
            read = list(RoundConfig.from_dict(json.loads(case["text"])).members)
        else:
            read = Topics(case["root"]).root
    except (EnvelopeError, ConfigError, ValueError) as exc:
        return f"REFUSE {exc}"
    except Exception as exc:            # noqa: BLE001 - reported, and fails the comparison
        return f"CRASH {type(exc).__name__}: {exc}"
    return "ACCEPT " + json.dumps(read, sort_keys=True, separators=(",", ":"), ensure_ascii=False)


def assert_same_decisions(java_cp: str, cases: list[dict], expected: list[str], words: int = 1) -> None:
    """Java decides as Python on every case (ACCEPT with the same values, or REFUSE and, with
    ``words`` 2, the same refusal class), and Python's decision is ``expected`` (the contract's)."""
    def brief(decision: str) -> str:
        return "ACCEPT" if decision.startswith("ACCEPT") else " ".join(decision.split()[:words])

    java = java_decisions(java_cp, cases)
    for case, want, got in zip(cases, expected, java):
        mine = python_decision(case)
        assert brief(mine) == want, (case.get("name"), mine)
        assert (got if got.startswith("ACCEPT") else brief(got)) == \
            (mine if mine.startswith("ACCEPT") else brief(mine)), (case.get("name"), mine, got)


# ---- deployment.assign ----

LEFT_OUT = object()


def assignment(name: str, **fields) -> dict:
    """A run assignment for jdev with ``fields`` put in (LEFT_OUT: the field left out)."""
    body = {"deployment": "dep-1", "device": "jdev", "seq": 7, "action": "run", "sha256": SHA,
            "nbytes": 1000, "model_id": 3, "bundle_sha256": "", **fields}
    body = {k: v for k, v in body.items() if v is not LEFT_OUT}
    env = Envelope(D.ASSIGN, "aggregator", body, id="0" * 32, ts=1767225600.0)
    return {"op": "assignment", "hex": encode(env).hex(), "name": name}


def test_an_assignments_ids_and_digests_are_whole_matches(java_cp):
    """``re.match`` with ``$`` took a trailing newline in the Python parser."""
    cases = [assignment("control"), assignment("deployment with a trailing newline", deployment="dep-1\n"),
             assignment("sha256 with a trailing newline", sha256=SHA + "\n"),
             assignment("bundle with a trailing newline", bundle_sha256=SHA + "\n"),
             assignment("bundle given", bundle_sha256=SHA),
             assignment("deployment of 64 characters", deployment="d" * 64),
             assignment("deployment of 65 characters", deployment="d" * 65)]
    assert_same_decisions(java_cp, cases, ["ACCEPT", "REFUSE", "REFUSE", "REFUSE", "ACCEPT", "ACCEPT", "REFUSE"])


def rollback(name: str, **fields) -> dict:
    body = {"deployment": "dep-1", "device": "jdev", "seq": 7, "action": "rollback", **fields}
    return {"op": "assignment", "hex": encode(Envelope(D.ASSIGN, "aggregator", body, id="0" * 32, ts=1767225600.0)).hex(),
            "name": name}


def test_a_rollbacks_reason_is_a_string_cut_to_500_characters(java_cp):
    """Python wrote any JSON value as its repr and cut it to 500 characters; Java read a non-string as
    "" and cut nothing."""
    cases = [rollback("reason given", reason="guard failed"), rollback("no reason"), rollback("reason 5", reason=5),
             rollback("reason null", reason=None), rollback("600 characters", reason="r" * 600),
             rollback("600 astral characters", reason=ASTRAL * 600)]
    assert_same_decisions(java_cp, cases, ["ACCEPT", "ACCEPT", "REFUSE", "REFUSE", "ACCEPT", "ACCEPT"])


def test_an_assignments_bundle_and_model_id_have_one_type(java_cp):
    """bundle_sha256: absent or "" (the device's own bundle) or a sha256, nothing else; model_id an
    integer (docs/protocol.md "Messages")."""
    cases = [assignment("bundle absent", bundle_sha256=LEFT_OUT), assignment("bundle null", bundle_sha256=None),
             assignment("bundle false", bundle_sha256=False), assignment("bundle 0", bundle_sha256=0),
             assignment("bundle []", bundle_sha256=[]),
             assignment("model_id absent", model_id=LEFT_OUT), assignment("model_id 3.0", model_id=3.0),
             assignment("model_id '3'", model_id="3"), assignment("model_id true", model_id=True),
             assignment("model_id 0", model_id=0)]
    assert_same_decisions(java_cp, cases, ["ACCEPT", "REFUSE", "REFUSE", "REFUSE", "REFUSE",
                                           "REFUSE", "REFUSE", "REFUSE", "REFUSE", "ACCEPT"])


def test_an_assignments_nbytes_and_model_id_are_read_whole_never_wrapped_to_64_bits(java_cp):
    """nbytes: 1 .. MAX_HEAD_BYTES, anything else refused with the number sent and the limit, in the
    same words by both devices (Java wrapped 2^63 .. 2^64 - 1 to a negative count and said that);
    model_id: any integer the wire takes. An integer past -2^63 .. 2^64 - 1 is refused by either
    device's envelope decoder before the body is read (each in its own words)."""
    sizes = [1, D.MAX_HEAD_BYTES, D.MAX_HEAD_BYTES + 1, 0, -1, -(2 ** 63), 2 ** 63 - 1, 2 ** 63, 2 ** 63 + 1000,
             2 ** 64 - 1]
    assert_same_decisions(java_cp, [assignment(f"nbytes {n}", nbytes=n) for n in sizes],
                          ["ACCEPT", "ACCEPT"] + [f"REFUSE head of {n} bytes: at most {D.MAX_HEAD_BYTES}"
                                                  for n in sizes[2:]], words=99)
    ids = [-(2 ** 63), -1, 2 ** 63, 2 ** 64 - 1]
    past = [2 ** 64, 2 ** 64 + 1000, 2 ** 70, -(2 ** 63) - 1]
    cases = [assignment(f"model_id {m}", model_id=m) for m in ids] + \
        [assignment(f"{field} {v}", **{field: v}) for field in ("nbytes", "model_id") for v in past]
    assert_same_decisions(java_cp, cases, ["ACCEPT"] * len(ids) + ["REFUSE"] * 2 * len(past))


def artifact(name: str, tensors: dict, asked: str = hashlib.sha256(b"head").hexdigest()) -> dict:
    env = Envelope("artifact", "aggregator", {"sha256": asked, "name": "dep-1.npz"}, tensors)
    return {"op": "artifact", "hex": encode(env).hex(), "sha256": asked, "name": name}


def test_an_artifact_is_one_uint8_data_tensor_refused_in_one_class(java_cp):
    """The Java device took an artifact's first tensor whatever its name or shape (a 2-D one, or
    ``x`` before ``data``), the Python device the one named ``data``; a malformed artifact was
    refused in class ``load`` by Java and ``hash`` by Python, which now keeps ``hash`` for a head
    that does not hash to the assignment (docs/protocol.md "Model rollout")."""
    head = np.frombuffer(b"head", dtype=np.uint8)
    cases = [artifact("control", {"data": head}), artifact("another digest", {"data": head}, asked=SHA),
             artifact("x before data", {"x": head, "data": head}), artifact("data before x", {"data": head, "x": head}),
             artifact("2-D data", {"data": head.reshape(2, 2)}), artifact("int8 data", {"data": head.view(np.int8)}),
             artifact("no tensor", {})]
    assert_same_decisions(java_cp, cases, ["ACCEPT", "REFUSE hash"] + ["REFUSE load"] * 5, words=2)


def test_artifact_names_and_asked_digests_are_whole_matches():
    """The same ``$`` on the artifact side (the Python device's head, the aggregator's ``artifact.get``)."""
    data = b"head"
    digest = hashlib.sha256(data).hexdigest()
    ok = Envelope("artifact", "aggregator", {"sha256": digest, "name": "dep-1.npz"},
                  {"data": np.frombuffer(data, dtype=np.uint8)})
    assert parse_artifact(ok, digest) == ("dep-1.npz", data)
    with pytest.raises(EnvelopeError, match="plain file name"):
        parse_artifact(Envelope("artifact", "aggregator", {"sha256": digest, "name": "dep-1.npz\n"}, ok.tensors), digest)
    with pytest.raises(EnvelopeError, match="hex sha256"):
        check_sha(digest + "\n")


# ---- job.ended, round configs: characters are code points ----

def ended(name: str, job: str) -> dict:
    env = job_ended_message("aggregator", [JobEnded(job, "0123abcd", "done")]) if len(job) <= 128 else \
        Envelope("job.ended", "aggregator", {"ended": [{"job": job, "run": "0123abcd", "reason": "done"}]})
    return {"op": "job.ended", "hex": encode(env).hex(), "name": name}


def test_a_job_ended_job_id_is_at_most_128_characters_not_utf16_units(java_cp):
    cases = [ended("128 ASCII", "j" * 128), ended("129 ASCII", "j" * 129),
             ended("100 astral characters (200 UTF-16 units)", ASTRAL * 100), ended("128 astral", ASTRAL * 128),
             ended("129 astral", ASTRAL * 129)]
    assert_same_decisions(java_cp, cases, ["ACCEPT", "REFUSE", "ACCEPT", "ACCEPT", "REFUSE"])


def config_text(**fields) -> str:
    config = RoundConfig.create(job_id="job", round_id=3, group_id="g3", aggregator_id="aggregator",
                                members=["a", "b", "c", "d"], vector_length=8, bound=10.0, graph="complete")
    return json.dumps({**config.to_dict(), **fields})


def test_round_config_ids_are_at_most_256_characters_not_utf16_units(java_cp):
    members = sorted(["a", "b", "c", ASTRAL * 200])
    cases = [{"op": "round_config", "text": config_text(), "name": "control"},
             {"op": "round_config", "text": config_text(members=members), "name": "a member of 200 astral characters"},
             {"op": "round_config", "text": config_text(members=sorted(["a", "b", "c", ASTRAL * 257])),
              "name": "a member of 257 astral characters"},
             {"op": "round_config", "text": config_text(job_id=ASTRAL * 256), "name": "job_id of 256 astral"},
             {"op": "round_config", "text": config_text(group_id=ASTRAL * 256), "name": "group_id of 256 astral"},
             {"op": "round_config", "text": config_text(group_id="g" * 257), "name": "group_id of 257"}]
    assert_same_decisions(java_cp, cases, ["ACCEPT", "ACCEPT", "REFUSE", "ACCEPT", "ACCEPT", "REFUSE"])


# ---- topic roots: one rule (protocols/topics.py TOPIC_ROOT_PATTERN) ----

def test_a_topic_root_follows_one_rule_on_both_devices(java_cp):
    roots = ["fedfleet", "a/b", "/fedfleet", "fed+fleet", "fed#", "", "fed\nfleet", "fed\x00", "fed\x7f",
             "r" * 128, "r" * 129, ASTRAL * 128, ASTRAL * 129, "caf\u00e9"]
    cases = [{"op": "topic_root", "root": r, "name": repr(r)} for r in roots]
    assert_same_decisions(java_cp, cases, ["ACCEPT", "ACCEPT", "REFUSE", "REFUSE", "REFUSE", "REFUSE", "REFUSE",
                                           "REFUSE", "ACCEPT", "ACCEPT", "REFUSE", "ACCEPT", "REFUSE", "ACCEPT"])
