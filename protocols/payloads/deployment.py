"""Model rollout over the broker (issue 29): which version a device should run, the head it
fetches, and what it says about it. Topics (``protocols.topics.Topics``):

    {root}/v1/deploy/{device}        aggregator -> device, RETAINED: the device's assignment (so an
                                     offline device catches up when it reconnects)
    {root}/v1/deploy/{device}/out    device -> aggregator: ``artifact.get`` for the head, reports
    {root}/v1/deploy/{device}/in     aggregator -> device: the head (``artifact``, chunked)

* ``deployment.assign``  body ``{"deployment": id, "action": "run", "sha256": hex, "nbytes": int,
  "model_id": int, "bundle_sha256": hex or ""}`` — run this head (fetch it by sha256 unless kept)
  on the features of that exported bundle ("": the device's own); or ``{"deployment": id,
  "action": "rollback", "reason": text}`` — go back to the version run before that deployment.
  Signed by the aggregator; a device holding the aggregator's key refuses an unsigned one.
* ``deployment.report``  body ``{"deployment": id, "sha256": hex, "n": int, "correct_candidate":
  int, "correct_current": int}``: counts on the device's held-out split, never a sample; or
  ``{"deployment": id, "sha256": hex, "refused": text}`` when it cannot fetch, verify or load the
  head (it keeps running its version).

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
from .artifacts import check_sha

ASSIGN, REPORT = "deployment.assign", "deployment.report"
RUN, ROLLBACK = "run", "rollback"
MAX_HEAD_BYTES = 64 * 1024 * 1024
_ID = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")
_HEAD_NAMES = (("coef", "intercept"), ("weight", "bias"))


def check_deployment_id(value) -> str:
    if not isinstance(value, str) or not _ID.match(value):
        raise EnvelopeError(f"deployment id {value!r}: use 1-64 of [A-Za-z0-9_.-]")
    return value


def run_message(sender: str, deployment: str, sha256: str, nbytes: int, model_id: int,
                bundle_sha256: str = "") -> Envelope:
    return Envelope(type=ASSIGN, sender=sender, body={"deployment": check_deployment_id(deployment), "action": RUN,
                                                      "sha256": check_sha(sha256), "nbytes": int(nbytes),
                                                      "model_id": int(model_id),
                                                      "bundle_sha256": check_sha(bundle_sha256) if bundle_sha256 else ""})


def rollback_message(sender: str, deployment: str, reason: str) -> Envelope:
    return Envelope(type=ASSIGN, sender=sender, body={"deployment": check_deployment_id(deployment),
                                                      "action": ROLLBACK, "reason": str(reason)[:500]})


def parse_assignment(env: Envelope) -> dict:
    if env.type != ASSIGN:
        raise EnvelopeError(f"expected {ASSIGN}, got {env.type!r}")
    out = {"deployment": check_deployment_id(body_field(env, "deployment", str)),
           "action": body_field(env, "action", str)}
    if out["action"] == RUN:
        out["sha256"] = check_sha(body_field(env, "sha256", str))
        out["nbytes"], out["model_id"] = body_field(env, "nbytes", int), body_field(env, "model_id", int)
        bundle = env.body.get("bundle_sha256") or ""
        out["bundle_sha256"] = check_sha(bundle) if bundle else ""
        if not 0 < out["nbytes"] <= MAX_HEAD_BYTES:
            raise EnvelopeError(f"head of {out['nbytes']} bytes: at most {MAX_HEAD_BYTES}")
    elif out["action"] == ROLLBACK:
        out["reason"] = str(env.body.get("reason", ""))[:500]
    else:
        raise EnvelopeError(f"unknown deployment action {out['action']!r}")
    return out


def report_message(sender: str, deployment: str, sha256: str, n: int = 0, correct_candidate: int = 0,
                   correct_current: int = 0, refused: str = "") -> Envelope:
    body = {"deployment": check_deployment_id(deployment), "sha256": check_sha(sha256)}
    body.update({"refused": refused[:500]} if refused else
                {"n": int(n), "correct_candidate": int(correct_candidate), "correct_current": int(correct_current)})
    return Envelope(type=REPORT, sender=sender, body=body)


def parse_report(env: Envelope) -> dict:
    """The report's fields; EnvelopeError when counts are not 0 <= correct <= n."""
    if env.type != REPORT:
        raise EnvelopeError(f"expected {REPORT}, got {env.type!r}")
    out = {"deployment": check_deployment_id(body_field(env, "deployment", str)),
           "sha256": check_sha(body_field(env, "sha256", str))}
    if "refused" in env.body:
        out["refused"] = str(body_field(env, "refused", str))[:500] or "refused"
        return out
    for key in ("n", "correct_candidate", "correct_current"):
        out[key] = body_field(env, key, int)
    if not (0 <= out["correct_candidate"] <= out["n"] and 0 <= out["correct_current"] <= out["n"]):
        raise EnvelopeError(f"report counts {out} are not 0 <= correct <= n")
    return out


def head_from_npz(data: bytes, expected_sha256: str) -> tuple[np.ndarray, np.ndarray]:
    """(W (C, d), b (C,)) from a head file whose sha256 must be ``expected_sha256``; EnvelopeError
    on a digest mismatch (tampered) or anything that is not a finite linear head."""
    digest = hashlib.sha256(data).hexdigest()
    if digest != expected_sha256:
        raise EnvelopeError(f"head sha256 {digest[:16]}… differs from the assigned {expected_sha256[:16]}…")
    try:
        with np.load(io.BytesIO(data), allow_pickle=False) as z:
            names = next((pair for pair in _HEAD_NAMES if set(pair) <= set(z.files)), None)
            if names is None:
                raise EnvelopeError(f"head holds {sorted(z.files)}: expected coef/intercept or weight/bias")
            W, b = (np.asarray(z[n], dtype=np.float64) for n in names)
    except (ValueError, OSError, zipfile.BadZipFile) as exc:
        raise EnvelopeError(f"head is not a readable .npz: {exc}") from None
    if W.ndim != 2 or b.shape != (W.shape[0],) or not (np.isfinite(W).all() and np.isfinite(b).all()):
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
