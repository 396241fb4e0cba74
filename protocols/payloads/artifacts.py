"""Artifact distribution over the broker: a device asks for a file by its sha256, the aggregator
answers with the bytes (chunked like any large envelope), the device checks the digest.

* ``artifact.get``  device -> aggregator. body ``{"sha256": hex}``
* ``artifact``      aggregator -> device inbox. body ``{"sha256": hex, "name": file name}``,
                    tensor ``data`` (uint8, the file's bytes)
* ``artifact.missing``  aggregator -> device inbox. body ``{"sha256": hex, "request": id}``: this
                    aggregator holds no such file, so the device stops asking (it waited out its
                    whole timeout before). ``request`` is the ``id`` of the ``artifact.get`` it
                    answers: a device ends a fetch only on an answer to one of *this* fetch's asks,
                    so a genuine, signed "missing" recorded once (before the bundle was put on the
                    shelf) and replayed later ends nothing (a review's finding)

Files are content-addressed: a bundle is fetched by its manifest's sha256 (announced with the
job), then every file the manifest lists, by the sha256 the manifest gives. A device accepts no
byte whose digest differs, so a compromised broker or aggregator cannot swap a model. An ask
carries the digest alone, so of several files with the same bytes (two names in one bundle, or
in two bundles) the ``name`` of the answer is any of them: a bundle's file is written under its
manifest's name.
"""

from __future__ import annotations

import hashlib
import re

import numpy as np

from ..envelope import Envelope, EnvelopeError, body_field, require_tensor

GET, ARTIFACT, MISSING = "artifact.get", "artifact", "artifact.missing"
# matched whole (fullmatch): under re.match a "$" also matches before a final newline, and
# "<sha256>\n" or "dep-1.npz\n" passed here while the Java device refused them
_SHA = re.compile(r"[0-9a-f]{64}")
_NAME = re.compile(r"[A-Za-z0-9_.-]{1,128}")


def get_message(sender: str, sha256: str) -> Envelope:
    return Envelope(type=GET, sender=sender, body={"sha256": check_sha(sha256)})


def parse_get(env: Envelope) -> str:
    return check_sha(body_field(env, "sha256", str))


def missing_message(sender: str, sha256: str, request: str) -> Envelope:
    """The answer to the ``artifact.get`` whose envelope id is ``request``: no such file here."""
    return Envelope(type=MISSING, sender=sender, body={"sha256": check_sha(sha256), "request": request})


def answers_ask(env: Envelope, asked: set[str]) -> bool:
    """Whether ``env`` (an ``artifact.missing``) answers one of the asks whose ids are ``asked``."""
    request = env.body.get("request")
    return type(request) is str and request in asked


def artifact_message(sender: str, sha256: str, name: str, data: bytes) -> Envelope:
    return Envelope(type=ARTIFACT, sender=sender, body={"sha256": sha256, "name": name},
                    tensors={"data": np.frombuffer(data, dtype=np.uint8)})


class ArtifactDigestMismatch(EnvelopeError):
    """An artifact whose bytes do not hash to the sha256 asked for (a rollout's refusal class
    ``hash``; any other malformed artifact is no usable file: ``load``)."""


def parse_artifact(env: Envelope, expected_sha256: str) -> tuple[str, bytes]:
    """(name, bytes) if the content hashes to ``expected_sha256``; ArtifactDigestMismatch when it
    does not, EnvelopeError for anything else malformed."""
    if env.type != ARTIFACT:
        raise EnvelopeError(f"expected an artifact, got {env.type!r}")
    name = body_field(env, "name", str)
    if not _NAME.fullmatch(name):
        raise EnvelopeError(f"artifact name {name!r} is not a plain file name")
    if set(env.tensors) != {"data"}:         # as the Java device (ModelSlot.artifactBytes): one file, one tensor
        raise EnvelopeError("an artifact carries exactly one tensor, 'data'")
    data = require_tensor(env, "data", "uint8", (None,)).tobytes()
    digest = hashlib.sha256(data).hexdigest()
    if digest != expected_sha256:
        raise ArtifactDigestMismatch(f"artifact {name!r}: sha256 {digest[:16]}… differs from the requested "
                            f"{expected_sha256[:16]}…; refused")
    return name, data


def check_sha(value: str) -> str:
    if not isinstance(value, str) or not _SHA.fullmatch(value):
        raise EnvelopeError(f"not a hex sha256: {value!r}")
    return value
