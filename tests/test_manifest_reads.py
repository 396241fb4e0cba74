"""A bundle's files as an attacker in the device's bundle folder shapes them (a review's findings):
the manifest is read once, so the bytes whose digest matched the announced one are the bytes that
are parsed (it was hashed, then opened again: a manifest swapped in between was taken, and every
artifact it listed was then "verified" against the attacker's sha256s); an artifact whose size
differs from the manifest's, or that is no regular file, is refused before anything is read (a
claimed 2^40 bytes was allocated); a manifest nested past the parser's depth is a ManifestError."""

from __future__ import annotations

import dataclasses
import json
import hashlib
import os

import pytest

from edge_client.runtime import verification
from edge_client.runtime.errors import ArtifactTamperedError
from protocols.bundle_manifest import (ArtifactSpec, BatchSpec, InputNormalisation, Manifest, ManifestError,
                                       TensorSpec, read_manifest)


def manifest_for(program: bytes) -> Manifest:
    spec = ArtifactSpec(kind="inference", runtime="eager", runtime_version="2", file="inference_eager.pt",
                        sha256=hashlib.sha256(program).hexdigest(), size_bytes=len(program), batch=BatchSpec(None),
                        inputs=(TensorSpec("image", "float32", (None, 3, 8, 8)),),
                        outputs=(TensorSpec("features", "float32", (None, 4)),), parity={}, details={})
    return Manifest(backbone="mobilenet_v2", weights_sha256="0" * 64, feature_dim=4, num_classes=2,
                    temperature=0.1, output="features",
                    input=InputNormalisation(image_size=8, mean=(0.0, 0.0, 0.0), std=(1.0, 1.0, 1.0)),
                    artifacts=(spec,), created_with={})


def test_the_manifest_parsed_is_the_one_whose_digest_was_checked(tmp_path, monkeypatch):
    genuine_program, evil_program = b"genuine program bytes", b"attacker program bytes!"
    genuine, evil = manifest_for(genuine_program).dumps().encode(), manifest_for(evil_program).dumps().encode()
    path = tmp_path / "manifest.json"
    path.write_bytes(genuine)
    (tmp_path / "inference_eager.pt").write_bytes(evil_program)          # the attacker's file in the bundle
    real_parse = verification.parse_manifest

    def swap_then_parse(raw, where):            # a racing writer replaces the file after the digest check
        path.write_bytes(evil)
        return real_parse(raw, where)

    monkeypatch.setattr(verification, "parse_manifest", swap_then_parse)
    manifest = verification.load_manifest(path, hashlib.sha256(genuine).hexdigest())
    assert path.read_bytes() == evil and manifest.artifacts[0].sha256 == hashlib.sha256(genuine_program).hexdigest()
    with pytest.raises(ArtifactTamperedError):
        verification.read_verified(manifest, manifest.artifacts[0])
    with pytest.raises(ArtifactTamperedError, match="expected"):
        verification.load_manifest(path, hashlib.sha256(genuine).hexdigest())


def test_an_artifact_of_another_size_or_no_regular_file_is_refused_before_it_is_read(tmp_path):
    program = b"tiny program"
    genuine = manifest_for(program)
    (tmp_path / "inference_eager.pt").write_bytes(program)
    assert verification.read_verified(dataclasses.replace(genuine, directory=tmp_path), genuine.artifacts[0]) == program
    for claimed in (2 ** 40, 2 ** 63, len(program) - 1):
        spec = dataclasses.replace(genuine.artifacts[0], size_bytes=claimed)
        # past what a device reads, refused before the file is opened (a sparse file that size was
        # a MemoryError); within it, by its size
        why = (f"says {claimed} bytes, more than a device reads" if claimed > verification.MAX_ARTIFACT_BYTES
               else f"size differs.*{len(program)} bytes where it says {claimed}")
        with pytest.raises(ArtifactTamperedError, match=why):
            verification.read_verified(dataclasses.replace(genuine, artifacts=(spec,), directory=tmp_path), spec)
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    spec = dataclasses.replace(genuine.artifacts[0], file="fifo")
    # no writer: opening it for reading blocked for ever (a review's finding); now refused at once
    with pytest.raises(ArtifactTamperedError, match="not a regular file"):
        verification.read_verified(dataclasses.replace(genuine, artifacts=(spec,), directory=tmp_path), spec)
    (tmp_path / "manifest.json").unlink(missing_ok=True)
    os.mkfifo(tmp_path / "manifest.json")
    with pytest.raises(ManifestError, match="not a regular file"):
        verification.load_manifest(tmp_path)


def test_a_manifest_nested_past_the_parsers_depth_is_a_manifest_error(tmp_path):
    (tmp_path / "manifest.json").write_text("[" * 50_000 + "]" * 50_000)      # 100 kB, under the 1 MiB bound
    with pytest.raises(ManifestError, match="not valid JSON"):
        read_manifest(tmp_path)


def test_a_manifest_naming_a_key_twice_is_refused_as_the_java_device_refuses_it(tmp_path):
    """A review's finding: the Python reader took the last of two values, the Java device's reader
    refused the file: the same manifest meant one bundle on one device and nothing on the other."""
    good = json.dumps(manifest_for(b"program").to_json())
    twice = good.replace('"feature_dim": 4', '"feature_dim": 4, "feature_dim": 8', 1)
    assert twice != good
    (tmp_path / "manifest.json").write_text(twice)
    with pytest.raises(ManifestError, match="duplicate key 'feature_dim'"):
        read_manifest(tmp_path)
    (tmp_path / "manifest.json").write_text(good)
    assert read_manifest(tmp_path).feature_dim == 4


@pytest.mark.parametrize("where,value", [
    (("artifacts", 0, "file"), "inference_eager.pt\n"),
    (("artifacts", 0, "sha256"), hashlib.sha256(b"p").hexdigest() + "\n"),
    (("backbone", "weights_sha256"), "0" * 64 + "\n"),
    (("artifacts", 0, "inputs", 0, "name"), "image\n"),
])
def test_a_name_or_digest_with_a_final_newline_is_refused(tmp_path, where, value):
    """A review's finding: the schema's patterns end in "$", which under Python's re (jsonschema's)
    also matches before a final newline, so a manifest listing "inference_eager.pt\\n" was read."""
    from protocols.bundle_manifest import MANIFEST_SCHEMA, parse_manifest

    data = json.loads(manifest_for(b"p").dumps())
    assert parse_manifest(json.dumps(data).encode(), tmp_path / "manifest.json").artifacts  # the control
    target = data
    for key in where[:-1]:
        target = target[key]
    target[where[-1]] = value
    with pytest.raises(ManifestError, match="does not match"):
        parse_manifest(json.dumps(data).encode(), tmp_path / "manifest.json")

    def patterns(node):
        if isinstance(node, dict):
            yield from ([node["pattern"]] if isinstance(node.get("pattern"), str) else [])
            for child in node.values():
                yield from patterns(child)
        elif isinstance(node, list):
            for child in node:
                yield from patterns(child)

    # the full match is ECMA-262's reading only for anchored patterns: every one is
    found = list(patterns(MANIFEST_SCHEMA))
    assert len(found) >= 4 and all(p.startswith("^") and p.endswith("$") for p in found)
