"""Model rollout over the broker (issue 29): which version a device should run, the head it
fetches, and what it says about it. Topics (``protocols.topics.Topics``):

    {root}/v1/deploy/{device}        aggregator -> device, RETAINED: the device's assignment (so an
                                     offline device catches up when it reconnects)
    {root}/v1/deploy/{device}/out    device -> aggregator: ``artifact.get`` for the head, reports
    {root}/v1/deploy/{device}/in     aggregator -> device: the head (``artifact``, chunked)

* ``deployment.assign``  body ``{"deployment": id, "device": id, "seq": int, "action": "run",
  "sha256": hex, "nbytes": int, "model_id": int, "bundle_sha256": hex or ""}`` — run this head
  (fetch it by sha256 unless kept) on the features of that exported bundle ("": the device's own);
  or ``{"deployment": id, "device": id, "seq": int, "action": "rollback", "reason": text}`` — go
  back to the version run before that deployment. Signed by the aggregator; a device holding the
  aggregator's key refuses an unsigned one. ``device`` names the one device it is for (a copy
  republished on another device's topic is refused) and ``seq`` is the aggregator's sequence,
  increasing with every assignment it sends a device (a rollback is a new, higher one): the
  device keeps the highest it accepted and refuses a lower one, so a captured assignment replayed
  later cannot take it back to an old version.
* ``deployment.report``  body ``{"deployment": id, "seq": int, "sha256": hex, "n": int,
  "correct_candidate": int, "correct_current": int}``: counts on the device's held-out split,
  never a sample, about the assignment ``seq``; or ``{"deployment": id, "seq": int, "sha256": hex,
  "refused": text, "reason": class}`` when it cannot fetch, verify or load the head (it keeps
  running its version); ``reason`` is one of ``REFUSAL_REASONS``.

The head is an ``.npz`` of a linear classifier over the backbone's features: ``coef`` (C, d) and
``intercept`` (C,) (Fed3R), or ``weight`` and ``bias`` (FedAvg); logits = features @ W.T + b.
"""

from __future__ import annotations

import hashlib
import io
import re
import zipfile

import numpy as np

from ..envelope import Envelope, EnvelopeError, body_field
from ..topics import check_device_id
from ..canonical_npz import read_canonical_npz
from .artifacts import check_sha

ASSIGN, REPORT = "deployment.assign", "deployment.report"
RUN, ROLLBACK = "run", "rollback"
# why a device refused an assignment or its head: the class the operator sees per deployment
# (the text beside it says the rest). signature: not signed by the aggregator; hash: the head does
# not hash to the assignment; stale: an assignment older than the one the device holds; device:
# an assignment for another device; timeout: no head in time; load: a head that is not a usable one
REFUSAL_REASONS = ("signature", "hash", "stale", "device", "timeout", "load")
MAX_SEQ = 2 ** 62
MAX_HEAD_BYTES = 64 * 1024 * 1024
MAX_REPORT_SAMPLES = 2 ** 31 - 1          # a device's held-out split, far above any real one
_ID = re.compile(r"[A-Za-z0-9_.-]{1,64}")           # matched whole: re.match's "$" took "dep-1\n"
_HEAD_NAMES = (("coef", "intercept"), ("weight", "bias"))


def check_deployment_id(value) -> str:
    if not isinstance(value, str) or not _ID.fullmatch(value):
        raise EnvelopeError(f"deployment id {value!r}: use 1-64 of [A-Za-z0-9_.-]")
    return value


def check_seq(value) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 0 < value < MAX_SEQ:
        raise EnvelopeError(f"assignment sequence {value!r}: an integer in 1..2**62-1")
    return value


def _addressed(deployment: str, device: str, seq: int) -> dict:
    return {"deployment": check_deployment_id(deployment), "device": check_device_id(device), "seq": check_seq(seq)}


def run_message(sender: str, deployment: str, sha256: str, nbytes: int, model_id: int,
                bundle_sha256: str = "", *, device: str, seq: int) -> Envelope:
    return Envelope(type=ASSIGN, sender=sender, body={**_addressed(deployment, device, seq), "action": RUN,
                                                      "sha256": check_sha(sha256), "nbytes": int(nbytes),
                                                      "model_id": int(model_id),
                                                      "bundle_sha256": check_sha(bundle_sha256) if bundle_sha256 else ""})


def rollback_message(sender: str, deployment: str, reason: str, *, device: str, seq: int) -> Envelope:
    return Envelope(type=ASSIGN, sender=sender, body={**_addressed(deployment, device, seq),
                                                      "action": ROLLBACK, "reason": str(reason)[:500]})


def parse_assignment(env: Envelope) -> dict:
    """The assignment's fields; EnvelopeError for anything malformed (a missing device or sequence
    included: an assignment that names neither is one nobody can bind to a device and a time)."""
    if env.type != ASSIGN:
        raise EnvelopeError(f"expected {ASSIGN}, got {env.type!r}")
    try:
        device = check_device_id(body_field(env, "device", str))
    except ValueError as exc:
        raise EnvelopeError(str(exc)) from None
    out = {"deployment": check_deployment_id(body_field(env, "deployment", str)), "device": device,
           "seq": check_seq(body_field(env, "seq", int)), "action": body_field(env, "action", str)}
    if out["action"] == RUN:
        out["sha256"] = check_sha(body_field(env, "sha256", str))
        out["nbytes"], out["model_id"] = body_field(env, "nbytes", int), body_field(env, "model_id", int)
        # absent or "" (the device's own bundle), else a sha256: a null, false or 0 is no "" (the
        # Java device refuses them too)
        bundle = env.body.get("bundle_sha256", "")
        out["bundle_sha256"] = check_sha(bundle) if bundle != "" else ""
        if not 0 < out["nbytes"] <= MAX_HEAD_BYTES:
            raise EnvelopeError(f"head of {out['nbytes']} bytes: at most {MAX_HEAD_BYTES}")
    elif out["action"] == ROLLBACK:
        # a string (absent: ""), cut to 500 characters, as the Java device reads it
        out["reason"] = str(body_field(env, "reason", str) if "reason" in env.body else "")[:500]
    else:
        raise EnvelopeError(f"unknown deployment action {out['action']!r}")
    return out


def report_message(sender: str, deployment: str, sha256: str, n: int = 0, correct_candidate: int = 0,
                   correct_current: int = 0, refused: str = "", *, seq: int, reason: str = "load") -> Envelope:
    body = {"deployment": check_deployment_id(deployment), "seq": check_seq(seq), "sha256": check_sha(sha256)}
    body.update({"refused": refused[:500], "reason": check_reason(reason)} if refused else
                {"n": int(n), "correct_candidate": int(correct_candidate), "correct_current": int(correct_current)})
    return Envelope(type=REPORT, sender=sender, body=body)


def check_reason(value) -> str:
    if value not in REFUSAL_REASONS:
        raise EnvelopeError(f"refusal reason {str(value)[:40]!r}: one of {', '.join(REFUSAL_REASONS)}")
    return value


def parse_report(env: Envelope) -> dict:
    """The report's fields; EnvelopeError when counts are not 0 <= correct <= n."""
    if env.type != REPORT:
        raise EnvelopeError(f"expected {REPORT}, got {env.type!r}")
    out = {"deployment": check_deployment_id(body_field(env, "deployment", str)),
           "seq": check_seq(body_field(env, "seq", int)), "sha256": check_sha(body_field(env, "sha256", str))}
    if "refused" in env.body:
        out["refused"] = str(body_field(env, "refused", str))[:500] or "refused"
        out["reason"] = check_reason(env.body.get("reason"))
        return out
    for key in ("n", "correct_candidate", "correct_current"):
        out[key] = body_field(env, key, int)
    if not (0 <= out["correct_candidate"] <= out["n"] and 0 <= out["correct_current"] <= out["n"]):
        raise EnvelopeError(f"report counts {out} are not 0 <= correct <= n")
    if out["n"] > MAX_REPORT_SAMPLES:       # the aggregator scales counts by floats: 10**400 would not convert
        raise EnvelopeError(f"report of {out['n']} held-out samples: at most {MAX_REPORT_SAMPLES}")
    return out


def head_from_npz(data: bytes, expected_sha256: str) -> tuple[np.ndarray, np.ndarray]:
    """(W (C, d), b (C,)) from a head file whose sha256 must be ``expected_sha256``; EnvelopeError
    on a digest mismatch (tampered) or anything that is not a finite linear head."""
    digest = hashlib.sha256(data).hexdigest()
    if digest != expected_sha256:
        raise EnvelopeError(f"head sha256 {digest[:16]}… differs from the assigned {expected_sha256[:16]}…")
    if len(data) > MAX_HEAD_BYTES:          # as the Java device (HeadFile.parse): the file, whatever it inflates to
        raise EnvelopeError(f"head of {len(data):,} bytes: at most {MAX_HEAD_BYTES:,}")
    try:
        # at most a head's bytes once inflated: a 1 MB file of zeros declaring (16384, 16384) took
        # 3.3 GiB under the 2 GiB default (a review's finding; Java's reader stops at 64 MiB)
        arrays = read_canonical_npz(data, MAX_HEAD_BYTES)
        names = next((pair for pair in _HEAD_NAMES if set(pair) <= set(arrays)), None)
        if names is None:
            raise EnvelopeError(f"head holds {sorted(arrays)}: expected coef/intercept or weight/bias")
        for n, a in arrays.items():     # every member, as the Java device (HeadFile.java); C order: read_canonical_npz's
            if a.dtype.kind != "f" or a.dtype.itemsize not in (4, 8) or a.dtype.byteorder == ">":
                raise EnvelopeError(f"head array {n!r} is {a.dtype.str}: a little-endian float32 or float64 array "
                                    "in C order is what devices read")
        W, b = (np.asarray(arrays[n], dtype=np.float64) for n in names)
    except ValueError as exc:
        raise EnvelopeError(f"head is not a readable .npz: {exc}") from None
    if W.ndim != 2 or b.shape != (W.shape[0],) or W.size == 0 or not (np.isfinite(W).all() and np.isfinite(b).all()):
        raise EnvelopeError(f"head shapes {W.shape} / {b.shape} are not (C, d) / (C,) finite")
    return W, b


def head_npz(W: np.ndarray, b: np.ndarray) -> bytes:
    """The head file (``weight`` float32 (C, d), ``bias`` float32 (C,)), byte-identical for the same
    arrays: fixed zip dates, so its sha256 names the head wherever and whenever it is written."""
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", zipfile.ZIP_STORED) as z:
        for name, array in (("weight", W), ("bias", b)):
            info = zipfile.ZipInfo(f"{name}.npy", date_time=(1980, 1, 1, 0, 0, 0))
            with z.open(info, "w") as f:
                np.lib.format.write_array(f, np.ascontiguousarray(array, dtype=np.float32), allow_pickle=False)
    return buf.getvalue()


def head_arrays(arrays: dict[str, np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    """(W, b) of a stored model's arrays (a Fed3R or FedAvg head); ValueError for anything else."""
    names = next((pair for pair in _HEAD_NAMES if set(pair) <= set(arrays)), None)
    if names is None:
        raise ValueError(f"the model holds {sorted(arrays)}, not a linear head (coef/intercept or weight/bias)")
    return arrays[names[0]], arrays[names[1]]
