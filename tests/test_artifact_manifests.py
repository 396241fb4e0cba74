"""Bundle manifests that must not be served or followed: one misstating a file's size is refused when
the shelf indexes it; one that is not a manifest, names a file outside the bundle or the manifest
itself, or lists more than the fetch takes is refused before any file is asked for; a bundle whose listed
file is a folder is refused when indexed."""

import shutil

import pytest

from aggregator.service.artifacts import ArtifactShelf
from edge_client.artifacts import ArtifactFetchError, fetch_bundle
from protocols.mqtt_link import BrokerConfig

from artifact_serving import answering, one_file_manifest
from artifact_serving import bundle  # noqa: F401 (fixture)


def test_a_bundle_whose_manifest_misstates_a_files_size_is_refused_when_indexed(tmp_path, bundle):
    """Devices hold no reply past the size a manifest gives its file: a bundle stating too small a
    size was served, and every device waited out its fetch's timeout. The shelf refuses it up front."""
    import json

    copy = tmp_path / "misstated"
    shutil.copytree(bundle, copy)
    manifest = json.loads((copy / "manifest.json").read_text())
    manifest["artifacts"][0]["size_bytes"] -= 1
    (copy / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(ValueError, match=f"its manifest says {manifest['artifacts'][0]['size_bytes']}"):
        ArtifactShelf().add_bundle(copy)
    ArtifactShelf().add_bundle(bundle)                          # the bundle as exported is indexed


def test_a_bundle_listing_a_folder_as_a_file_is_refused_when_indexed_even_at_the_listed_size(tmp_path, bundle):
    """A review's finding: the shelf compared the size on disk with the manifest's, then hashed the path,
    so a folder in a file's place whose size (a folder's, 4 KiB here) matched escaped as an
    IsADirectoryError. It is refused as any file that is not the one listed is: one ValueError."""
    import json

    copy = tmp_path / "folder"
    shutil.copytree(bundle, copy)
    manifest = json.loads((copy / "manifest.json").read_text())
    listed = copy / manifest["artifacts"][0]["file"]
    listed.unlink()
    listed.mkdir()
    manifest["artifacts"][0]["size_bytes"] = listed.stat().st_size
    (copy / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(ValueError, match=f"{listed}: not a regular file"):
        ArtifactShelf().add_bundle(copy)


def test_a_manifest_that_is_not_one_or_lists_more_than_a_fetch_takes_is_refused_before_any_file(
        broker, tmp_path, bundle):
    """A review's finding: the fetch took the manifest's file list as it came (``json.loads``, then
    ``spec["sha256"]``), so a manifest that was not one escaped as a KeyError or a decoding error, one
    listing a file named ``manifest.json`` replaced the manifest the digest vouched for, and a list of
    files of any total size was fetched and held in memory together. The manifest is now read as every
    manifest is (the schema, the consistency rules) and its files may hold no more than the fetch's
    bound, each refused before any file is asked for; a good one is written file by file."""
    import hashlib
    import json

    cfg = BrokerConfig.from_url(broker.url)
    program = b"a program of 24 bytes..."
    served = {hashlib.sha256(program).hexdigest(): ("head.pte", program)}
    asked = []

    def serve_manifest(manifest: bytes) -> str:
        sha = hashlib.sha256(manifest).hexdigest()
        served[sha] = ("manifest.json", manifest)
        return sha

    good = one_file_manifest(bundle, "head.pte", program)
    as_manifest = one_file_manifest(bundle, "manifest.json", program)
    escaping = json.loads(good)
    escaping["artifacts"][0]["file"] = "../head.pte"
    cases = [(json.dumps({"artifacts": [{"file": "head.pte"}]}).encode(), "does not follow the schema at <root>"),
             (json.dumps(escaping).encode(), "does not follow the schema at artifacts/0/file"),
             (as_manifest, "lists file 'manifest.json' twice \\(or as the manifest\\)"),
             (b"[1, 2", "is not valid JSON")]
    with answering(broker, "cam1", served, asked):
        for i, (manifest, reason) in enumerate(cases):
            sha = serve_manifest(manifest)
            with pytest.raises(ArtifactFetchError, match=f"bundle {sha[:16]}…: .*{reason}"):
                fetch_bundle("cam1", cfg, sha, tmp_path / f"bad{i}", timeout_s=30)
            assert set(asked) == {sha} and not (tmp_path / f"bad{i}").exists()
            asked.clear()
        sha = serve_manifest(good)
        with pytest.raises(ArtifactFetchError, match=f"lists {len(program)} bytes of files, more than the "
                                                     f"{len(program) - 1} this device takes"):
            fetch_bundle("cam1", cfg, sha, tmp_path / "large", timeout_s=30, max_bundle_bytes=len(program) - 1)
        assert set(asked) == {sha} and not (tmp_path / "large").exists()
        got = fetch_bundle("cam1", cfg, sha, tmp_path / "good", timeout_s=30, max_bundle_bytes=len(program))
        assert got.read_bytes() == good and (got.parent / "head.pte").read_bytes() == program
        assert sorted(p.name for p in got.parent.iterdir()) == ["head.pte", "manifest.json"]
