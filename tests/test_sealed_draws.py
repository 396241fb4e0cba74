"""A sampled DP job's participant draw as the store keeps it (aggregator/service/sealed_draws.py):
its key sealed with AES-GCM under the aggregator's sealing key (aggregator/security/sealing_key.py),
kept outside the store, the job id bound in. The stored bookkeeping holds no word of the key; it
opens to the same draws; a value of another job, altered, or opened under another key folder is one
SealError; an earlier version's clear key resumes under a new key. The AES-GCM reference is the
`cryptography` package's, used here directly on the key file's bytes."""

from __future__ import annotations

import base64
import json
import logging
import stat

import pytest

from aggregator.jobs.participant_draw import KeyedDraw, draw_state
from aggregator.jobs.registry import build_job
from aggregator.security.sealing_key import SealError, SealingKey
from aggregator.service.sealed_draws import SEALED, SealedDraws
from protocols.rounds import RoundClosed

CONFIG = {"job_id": "job", "num_classes": 3, "feature_dim": 8, "clients_per_round": 5, "rounds": 100,
          "dp_noise_multiplier": 1.0, "dp_clip_norm": 1.0, "dp_population": 400}
POOL = {f"d{i:03d}" for i in range(200)}


def played(rounds: int = 3):
    job = build_job("fedavg", CONFIG)
    assert isinstance(job._rng, KeyedDraw)
    for _ in range(rounds):
        job.close_round(RoundClosed(job.round, (), tuple(job.next_participants(POOL)), (), ()))
    return job


def draws_of(job, rounds: int = 4) -> list[list[str]]:
    out = []
    for _ in range(rounds):
        out.append(job.next_participants(POOL))
        job.close_round(RoundClosed(job.round, (), tuple(out[-1]), (), ()))
    return out


def key_words(state: list) -> list[int]:
    return state[1][:4]


def test_the_stored_bookkeeping_holds_no_word_of_the_key_and_opens_to_the_same_draws(tmp_path):
    job = played()
    book = json.loads(json.dumps(job.bookkeeping()))
    key = SealingKey(tmp_path / "keys")
    stored = json.loads(json.dumps(SealedDraws(key).sealed(book, "job")))
    text = json.dumps(stored)
    words = key_words(book["rng"])
    assert stored["rng"][0] == SEALED and not any(str(w) in text for w in words if w > 10**6)
    assert {k: v for k, v in stored.items() if k != "rng"} == {k: v for k, v in book.items() if k != "rng"}
    # the sealed value is AES-256-GCM of the state under the key file's bytes, the job id in its associated data
    raw = base64.b64decode(stored["rng"][1])
    secret = (tmp_path / "keys" / SealingKey.FILE).read_bytes()
    from cryptography.hazmat.primitives.ciphers.aead import AESGCM
    assert json.loads(AESGCM(secret).decrypt(raw[:12], raw[12:], b"fedfleet participant draw\x00job")) == book["rng"]

    ahead = draws_of(job)
    resumed = build_job("fedavg", CONFIG)
    resumed.restore_bookkeeping(SealedDraws(SealingKey(tmp_path / "keys")).opened(stored, "job"))   # a new process
    assert draws_of(resumed) == ahead and any(ahead)


def test_the_key_file_is_the_owners_alone_and_made_once(tmp_path):
    key = SealingKey(tmp_path / "keys")
    key.check()                                   # nothing made before it is used
    assert not (tmp_path / "keys").exists()
    sealed = key.seal(b"secret", b"ctx")
    assert stat.S_IMODE((tmp_path / "keys").stat().st_mode) == 0o700
    assert stat.S_IMODE(key.path.stat().st_mode) == 0o600 and len(key.path.read_bytes()) == 32
    before = key.path.read_bytes()
    assert SealingKey(tmp_path / "keys").open(sealed, b"ctx") == b"secret"
    SealingKey(tmp_path / "keys").seal(b"again", b"ctx")
    assert key.path.read_bytes() == before


def sealed_book(tmp_path, job_id="job"):
    job = played()
    return SealedDraws(SealingKey(tmp_path / "keys")).sealed(job.bookkeeping(), job_id)


def altered(book: dict) -> dict:
    token = bytearray(base64.b64decode(book["rng"][1]))
    token[20] ^= 1
    return {**book, "rng": [SEALED, base64.b64encode(bytes(token)).decode(), None]}


@pytest.mark.parametrize("case", ["another job's row", "altered", "another key folder", "no key folder", "not base64"])
def test_a_sealed_draw_that_does_not_open_is_one_seal_error(tmp_path, case):
    book = sealed_book(tmp_path, "other" if case == "another job's row" else "job")
    folder = tmp_path / "keys"
    if case == "altered":
        book = altered(book)
    elif case == "another key folder":
        SealingKey(tmp_path / "elsewhere").seal(b"", b"")
        folder = tmp_path / "elsewhere"
    elif case == "no key folder":
        folder = tmp_path / "missing"
    elif case == "not base64":
        book = {**book, "rng": [SEALED, "%%%", None]}
    with pytest.raises(SealError, match="sealing key|does not open"):
        SealedDraws(SealingKey(folder)).opened(book, "job")


def test_a_clear_key_of_an_earlier_version_resumes_under_a_new_key_said_once(tmp_path, caplog):
    job = played()
    clear = json.loads(json.dumps(job.bookkeeping()))
    draws = SealedDraws(SealingKey(tmp_path / "keys"))
    with caplog.at_level(logging.WARNING, "fedfleet.aggregator"):
        first, second = draws.opened(clear, "job"), draws.opened(clear, "job")
    assert [r.getMessage() for r in caplog.records].count(
        "job job: its participant draw's key was stored in the clear by an earlier version: drawn under a new key "
        "from now on, stored sealed") == 1
    for opened in (first, second):
        assert opened["rng"][0] == KeyedDraw.VERSION and key_words(opened["rng"]) != key_words(clear["rng"])
        assert opened["rng"][1][4:] == [0, 0]                        # a new key's draw starts at block 0
    resumed = build_job("fedavg", CONFIG)
    resumed.restore_bookkeeping(first)
    assert resumed.round == job.round and any(draws_of(resumed))
    with pytest.raises(ValueError, match="keyed draw"):              # a damaged one is not replaced
        draws.opened({**clear, "rng": [KeyedDraw.VERSION, [1, 2, 3], None]}, "job")
    twister = {"rng": draw_state(__import__("random").Random(3))}
    assert draws.opened(twister, "job") == twister                   # what is no keyed draw passes as stored
    assert draws.sealed(twister, "job") == twister


def test_a_key_file_that_is_no_key_is_said_at_start(tmp_path):
    (tmp_path / "keys").mkdir()
    (tmp_path / "keys" / SealingKey.FILE).write_bytes(b"short")
    (tmp_path / "keys" / SealingKey.FILE).chmod(0o600)
    with pytest.raises(ValueError, match="holds 5 bytes"):
        SealingKey(tmp_path / "keys").check()


def test_a_key_folder_that_is_a_file_is_said_at_start(tmp_path):
    """``--key-dir`` naming a regular file: the check at start says so, one ValueError naming it.
    It passed (the key's path under a file 'does not exist'), and the first round of a sampled DP
    job failed on mkdir with FileExistsError, stopping the job instead of the start."""
    (tmp_path / "keys").write_text("not a folder")
    with pytest.raises(ValueError, match=r"keys.*is not a folder"):
        SealingKey(tmp_path / "keys").check()
    with pytest.raises(ValueError, match=r"keys.*is not a folder"):
        SealingKey(tmp_path / "keys").seal(b"secret", b"ctx")
    assert (tmp_path / "keys").read_text() == "not a folder"


KNOWN_KEY = bytes(range(32))
OTHER_UID = 65534       # nobody's: a user this test's process is not


def planted(tmp_path, case):
    """A key folder ``keys`` as someone else left it before the aggregator's first sampled DP job."""
    folder = tmp_path / "keys"
    folder.mkdir(mode=0o700)
    key = folder / SealingKey.FILE
    if case == "key file a link to a known key":
        (tmp_path / "known").write_bytes(KNOWN_KEY)
        (tmp_path / "known").chmod(0o600)
        key.symlink_to(tmp_path / "known")
    elif case == "key file a dangling link":
        key.symlink_to(tmp_path / "later")
    elif case.startswith("folder"):
        if case == "folder of another user":
            __import__("os").chown(folder, OTHER_UID, -1)
        else:
            folder.chmod(0o770 if "group" in case else 0o703)
    else:
        key.write_bytes(KNOWN_KEY)
        key.chmod(0o640 if "group" in case else 0o600)
        if case == "key file of another user":
            __import__("os").chown(key, OTHER_UID, -1)
    return folder


@pytest.mark.parametrize("case, reason", [
    ("key file a link to a known key", "symbolic link"),
    ("key file a dangling link", "symbolic link"),
    ("folder writable by group", r"\(mode 0770\) is writable by group or others"),
    ("folder writable by others", r"\(mode 0703\) is writable by group or others"),
    ("folder of another user", f"owned by uid {OTHER_UID}"),
    ("key file open to group", r"\(mode 0640\) is open to group or others"),
    ("key file of another user", f"owned by uid {OTHER_UID}"),
])
def test_a_key_folder_or_file_someone_else_may_write_or_own_is_refused_naming_it(tmp_path, case, reason):
    """A review's finding: whoever could write the key folder before first use chose the key (a link
    planted as the key file was followed, a shared folder's or file's mode and owner never looked
    at), and every draw was then sealed under a key they know. Each is one SealError naming the
    path, at start and when sealing; nothing is sealed and the planted file is left as it was."""
    folder = planted(tmp_path, case)
    named = str(folder) if case.startswith("folder") else str(folder / SealingKey.FILE)
    for attempt in (lambda: SealingKey(folder).check(), lambda: SealingKey(folder).seal(b"secret", b"ctx")):
        with pytest.raises(SealError, match=f"{named}.*{reason}"):
            attempt()
    if case == "key file a link to a known key":
        assert (tmp_path / "known").read_bytes() == KNOWN_KEY
    if case == "key file a dangling link":
        assert not (tmp_path / "later").exists()


def test_a_new_key_folder_is_0700_and_its_key_0600_and_an_existing_key_is_kept(tmp_path):
    key = SealingKey(tmp_path / "new" / "keys")
    sealed = key.seal(b"secret", b"ctx")
    folder_mode = stat.S_IMODE((tmp_path / "new" / "keys").stat().st_mode)
    file_status = (tmp_path / "new" / "keys" / SealingKey.FILE).lstat()
    assert (folder_mode, stat.S_IMODE(file_status.st_mode), file_status.st_size) == (0o700, 0o600, 32)
    assert stat.S_ISREG(file_status.st_mode)
    assert [p.name for p in (tmp_path / "new" / "keys").iterdir()] == [SealingKey.FILE]   # no temp file left
    assert SealingKey(tmp_path / "new" / "keys").open(sealed, b"ctx") == b"secret"
