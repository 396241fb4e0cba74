"""The key the aggregator seals its store's secrets under, kept outside the store.

The store (``--state FILE``, its WAL, its backups) holds what a job needs to resume, and a few of
those values are secrets: a sampled DP job's participant draw is AES-CTR under the job's own key
(``aggregator/jobs/participant_draw.py``), and whoever holds that key knows every later draw (the
amplification by sampling the accountant counts on is gone). So such a value is stored sealed,
AES-256-GCM under this key, and the key lives in a folder of the aggregator's secrets instead: the
broker security folder (``--security-dir``, with the aggregator's MQTT password and the CA's key),
or ``--key-dir``, else ``FILE.keys/`` beside the store. A copy of the store alone opens nothing.

The key is made on first use (32 random bytes, a 0600 file in a 0700 folder, written whole under a
temp name and linked in, never over a name already there); a store moved without it cannot open
what it sealed: :class:`SealError`, one line naming the file.

Whoever may write the key's folder, or its file, chooses the key: a link planted as the key file
before its first use (``ln -s /tmp/known KEYDIR/store-seal.key``) had every draw sealed under a key
they know. So a folder writable by group or others, or owned by another user, and a key file that
is a link, not a regular file, not this process's user's, or open to group or others, are refused
(:class:`SealError` naming the path and what is wrong), and the key file is read without
following a link.
"""

from __future__ import annotations

import base64
import binascii
import os
import stat
from pathlib import Path

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from protocols.files import write_atomic
from protocols.regular_file import not_regular, open_regular_fd

KEY_BYTES = 32          # AES-256
NONCE_BYTES = 12        # GCM's; random per sealed value (a key seals far fewer than 2^32 values)


class SealError(ValueError):
    """A sealed value that does not open: another key, another context (job), or altered."""


class SealingKey:
    """AES-256-GCM under the key file ``FILE`` in ``folder``, loaded (or made) when first used."""

    FILE = "store-seal.key"

    def __init__(self, folder: str | Path):
        self.folder = Path(folder)
        self.path = self.folder / self.FILE
        self._aead: AESGCM | None = None

    @classmethod
    def of_store(cls, store_path: str | Path, key_dir: str | Path | None = None) -> "SealingKey":
        """The key of the store at ``store_path``: in ``key_dir``, else in ``<store path>.keys/``."""
        store_path = Path(store_path)
        return cls(key_dir if key_dir is not None else store_path.with_name(store_path.name + ".keys"))

    def check(self) -> None:
        """Read the key now if its file exists (``ValueError`` naming it when it is not one), so a bad
        ``--key-dir`` is said at start, not at the first round of a sampled DP job; a folder that
        is a file is one too (the key's path under it does not exist, and making it failed then)."""
        self._check_folder()
        if os.path.lexists(self.path):
            self._key(create=False)

    def seal(self, secret: bytes, context: bytes) -> str:
        """``secret`` sealed, bound to ``context`` (associated data: who it belongs to), as text."""
        nonce = os.urandom(NONCE_BYTES)
        return base64.b64encode(nonce + self._key(create=True).encrypt(nonce, secret, context)).decode("ascii")

    def open(self, sealed: str, context: bytes) -> bytes:
        """The secret :meth:`seal` sealed with ``context``; :class:`SealError` when it does not open."""
        try:
            raw = base64.b64decode(sealed.encode("ascii"), validate=True) if isinstance(sealed, str) else b""
        except (UnicodeEncodeError, binascii.Error):
            raw = b""
        if not os.path.lexists(self.path):
            raise SealError(f"no sealing key at {self.path}: a sealed value opens only with the key folder it was "
                            f"sealed under (--key-dir)")
        aead = self._key(create=False)          # a refused key file is said as such, not as a value not opening
        try:
            return aead.decrypt(raw[:NONCE_BYTES], raw[NONCE_BYTES:], context)
        except (InvalidTag, ValueError):
            raise SealError(f"a sealed value does not open under {self.path}: sealed under another key, for "
                            f"another job, or altered") from None

    def _check_folder(self) -> None:
        try:
            folder = os.stat(self.folder)
        except FileNotFoundError:
            return
        if not stat.S_ISDIR(folder.st_mode):
            raise SealError(f"sealing key folder {self.folder} is not a folder (--key-dir names the folder of the key)")
        _refuse_shared(self.folder, folder, "sealing key folder", stat.S_IWGRP | stat.S_IWOTH,
                       "writable by group or others: whoever may write it chooses the key; make it 0700")

    def _key(self, create: bool) -> AESGCM:
        if self._aead is None:
            self._check_folder()
            if create and not os.path.lexists(self.path):
                self._make()
            key = self._read()
            if len(key) != KEY_BYTES:
                raise SealError(f"sealing key {self.path} holds {len(key)} bytes, not a key of {KEY_BYTES}")
            self._aead = AESGCM(key)
        return self._aead

    def _make(self) -> None:
        """A new key, written whole under a temp name (0600 from its first byte) and linked in as the
        key file: a link never replaces a name (another process's key, a link planted there) but
        fails, and that name is then read and judged like any key file."""
        self.folder.mkdir(mode=0o700, parents=True, exist_ok=True)
        self._check_folder()                # one that was there keeps its mode
        write_atomic(self.path, os.urandom(KEY_BYTES), f".{self.FILE}.", replace=False)

    def _read(self) -> bytes:
        try:
            fd = open_regular_fd(self.path, follow_links=False)
        except OSError as exc:
            kind = not_regular(exc)
            raise SealError(f"sealing key {self.path}{' ' + kind if kind else ': ' + exc.strerror}") from None
        with os.fdopen(fd, "rb") as handle:
            _refuse_shared(self.path, os.fstat(fd), "sealing key", stat.S_IRWXG | stat.S_IRWXO,
                           "open to group or others: whoever may read it opens what it sealed; make it 0600")
            return handle.read(4 * KEY_BYTES)


def _refuse_shared(path: Path, status: os.stat_result, what: str, shared_bits: int, shared_why: str) -> None:
    """SealError unless ``path`` (``status`` its stat) is this process's user's and none of
    ``shared_bits`` (group's and others') is set; ``shared_why`` says what is wrong then."""
    if status.st_uid != os.geteuid():
        raise SealError(f"{what} {path} is owned by uid {status.st_uid}, not by this process's user "
                        f"(uid {os.geteuid()}): whoever owns it chooses the key")
    if status.st_mode & shared_bits:
        raise SealError(f"{what} {path} (mode {stat.S_IMODE(status.st_mode):04o}) is {shared_why}")
