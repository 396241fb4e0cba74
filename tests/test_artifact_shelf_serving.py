"""What the aggregator's shelf sends for an indexed file is the file it indexed, or nothing: a bundle
folder changed on disk after ``aggregator serve --artifacts`` indexed it (a listed file swapped for a
link to a file outside the folder, for a FIFO, or rewritten) is answered ``artifact.missing``, never
with other bytes, and never blocks the service loop."""

import hashlib
import json
import os
import shutil
import threading

from aggregator.service.artifacts import ArtifactShelf, artifact_reply
from protocols.payloads.artifacts import ARTIFACT, MISSING, get_message

from artifact_serving import bundle  # noqa: F401 (fixture)


def _shelved_copy(bundle, tmp_path):
    copy = tmp_path / "served"
    shutil.copytree(bundle, copy)
    shelf = ArtifactShelf([copy])
    spec = json.loads((copy / "manifest.json").read_bytes())["artifacts"][0]
    return copy, shelf, spec


def _answer(shelf, sha):
    reply, _ = artifact_reply(shelf, "cam1", get_message("cam1", sha))
    return reply


def test_a_listed_file_swapped_for_a_link_outside_the_folder_is_not_served(tmp_path, bundle):
    """A review's finding: the shelf checked each file when it indexed the bundle, then read whatever
    the path named when a device asked (``Path.read_bytes``): a file replaced by a symlink to one
    outside the folder was sent, bytes and all, to any device asking by the indexed sha256."""
    copy, shelf, spec = _shelved_copy(bundle, tmp_path)
    secret = tmp_path / "outside.key"
    secret.write_bytes(b"the aggregator's private key\n" * 8)
    (copy / spec["file"]).unlink()
    (copy / spec["file"]).symlink_to(secret)
    reply = _answer(shelf, spec["sha256"])
    assert reply is not None and reply.type == MISSING
    assert "data" not in reply.tensors


def test_a_listed_file_rewritten_after_indexing_is_not_served(tmp_path, bundle):
    """Bytes the shelf did not index (a file rewritten, or grown past its indexed size) are not sent:
    the answer's content hashes to what the device asked for, or there is no file."""
    copy, shelf, spec = _shelved_copy(bundle, tmp_path)
    with open(copy / spec["file"], "ab") as grown:
        grown.write(b"\0" * 4096)
    assert _answer(shelf, spec["sha256"]).type == MISSING
    manifest_sha = shelf.bundles[0]
    assert _answer(shelf, manifest_sha).type == ARTIFACT        # the manifest itself is unchanged
    (copy / "manifest.json").write_bytes((copy / "manifest.json").read_bytes().replace(b"  ", b" "))
    assert _answer(shelf, manifest_sha).type == MISSING       # its second answer: the limiter allows it


def test_a_listed_file_swapped_for_a_fifo_does_not_block_the_service(tmp_path, bundle):
    """Opening a FIFO for reading waits for a writer for ever: the shelf's read of one held the
    aggregator's service loop (every device's messages) until someone wrote to it."""
    copy, shelf, spec = _shelved_copy(bundle, tmp_path)
    (copy / spec["file"]).unlink()
    os.mkfifo(copy / spec["file"])
    answers = []
    asker = threading.Thread(target=lambda: answers.append(_answer(shelf, spec["sha256"])), daemon=True)
    asker.start()
    asker.join(timeout=10)
    if asker.is_alive():                     # release the blocked read so the test process can end
        fd = os.open(copy / spec["file"], os.O_WRONLY | os.O_NONBLOCK)
        os.close(fd)
        asker.join(timeout=10)
        raise AssertionError("the shelf blocked on a FIFO in place of an indexed file")
    assert answers[0].type == MISSING


def test_an_unchanged_bundle_is_served_byte_for_byte(tmp_path, bundle):
    copy, shelf, spec = _shelved_copy(bundle, tmp_path)
    reply = _answer(shelf, spec["sha256"])
    assert reply.type == ARTIFACT and reply.body["name"] == spec["file"]
    assert reply.tensors["data"].tobytes() == (bundle / spec["file"]).read_bytes()
    assert hashlib.sha256(reply.tensors["data"].tobytes()).hexdigest() == spec["sha256"]
