"""The one zip layout both device SDKs take for a file they both read (a deployed head), and its
members as both read them.

zipfile (which numpy's ``load`` uses) reads a zip from its end record and central directory;
``java.util.zip.ZipInputStream`` reads the local headers front to back, and each tolerates its own
oddities. Files crafted on those differences (a size, a CRC, a method or a name that differs between
a local header and the directory, an entry the directory leaves out, an end record or a zip64
record inside a comment, a NUL in a name, bytes after a deflate stream) were one head to one device
and another head, or a refusal, to the other, under one sha256 (three review helpers crafted and
fuzzed them). So neither device hands such a file to a general zip reader: each reads the members
itself, here and in ``ZipLayout.java``, by the same rules in the same order, and takes a file only
when its layout leaves nothing to choose:

1. the end record is the file's last 22 bytes, with no comment; one disk; its directory ends where
   the record starts; no entry has a comment (numpy and zipfile write none: a comment is where a
   second directory and end record hid, for zipfile to take);
2. the directory's entries, in order, point at local headers that lie back to back from the file's
   first byte, the last one's data ending where the directory starts;
3. each entry's local header and directory entry agree on flags, method, CRC, sizes and name; flags
   only the deflate options and UTF-8 (no encryption, no data descriptor); stored or deflated; a
   stored entry's two sizes equal; names of ``A-Z a-z 0-9 _ . -`` only; extra fields well formed;
4. sizes are in the 32-bit fields, except a local header whose two sizes are both 0xFFFFFFFF and
   whose one zip64 field (id 1) holds them (numpy's ``savez`` writes them so); the directory holds
   none;
5. the members' sizes together are within the reader's bound, checked before anything is inflated;
   a deflated entry's stream ends exactly at its compressed size and inflates to its size, and every
   member's bytes hash to its CRC.

What numpy (``savez``, ``savez_compressed``), zipfile and ``head_npz`` write to a file or a buffer
follows these rules; ``tests/test_head_bytes.py`` holds both devices to one verdict.
"""

from __future__ import annotations

import re
import struct
import zlib
from dataclasses import dataclass

_LOCAL = struct.Struct("<IHHHHHIIIHH")              # 30 bytes, signature 0x04034b50
_CENTRAL = struct.Struct("<IHHHHHHIIIHHHHHII")      # 46 bytes, signature 0x02014b50
_END = struct.Struct("<IHHHHIIH")                   # 22 bytes, signature 0x06054b50
_MARK = 0xFFFFFFFF                                  # a size held in the zip64 field
_STORED, _DEFLATED = 0, 8
_FLAGS = 0x0806                                     # what a flag word may hold: deflate options, UTF-8
_NAME = re.compile(rb"[A-Za-z0-9_.-]{1,255}")


@dataclass(frozen=True)
class Entry:
    name: str
    content: bytes          # the member's bytes (inflated, if it was deflated)


def read_zip_members(data: bytes, max_bytes: int) -> list[Entry]:
    """The members of ``data``, in order, when its layout follows the module's rules and they hold
    at most ``max_bytes`` together; ValueError naming the first rule it breaks."""
    end = _end_record(data)
    _, disk, directory_disk, disk_entries, count, directory_size, directory_at, _ = _END.unpack_from(data, end)
    if disk or directory_disk or disk_entries != count or directory_at + directory_size != end:
        raise ValueError("the zip's end record does not close its directory (or names another disk)")
    entries, local_at, at = [], 0, directory_at
    for _ in range(count):
        if at + _CENTRAL.size > end or _CENTRAL.unpack_from(data, at)[0] != 0x02014B50:
            raise ValueError("the zip's directory is cut short")
        (_, _, _, flags, method, _, _, crc, compressed, size, name_length, extra_length, comment_length,
         _, _, _, offset) = _CENTRAL.unpack_from(data, at)
        name = data[at + _CENTRAL.size:at + _CENTRAL.size + name_length]
        at += _CENTRAL.size + name_length + extra_length + comment_length
        if at > end or _MARK in (compressed, size, offset) or comment_length:
            raise ValueError("a zip directory entry is cut short, has a comment, or holds its sizes in a zip64 field")
        _fields(data[at - extra_length - comment_length:at - comment_length], name)
        local_at = _local_entry(data, local_at, offset, flags, method, crc, compressed, size, name)
        entries.append((name, method, size, crc, local_at - compressed, compressed))
    if at != end or local_at != directory_at:
        raise ValueError("the zip holds more than its directory lists")
    if sum(entry[2] for entry in entries) > max_bytes:
        raise ValueError(f"the zip's members hold {sum(entry[2] for entry in entries):,} bytes, more than {max_bytes:,}")
    return [Entry(name.decode("ascii"), _content(data[start:start + compressed], method, size, crc, name))
            for name, method, size, crc, start, compressed in entries]


def _end_record(data: bytes) -> int:
    """Where the end record is: the file's last 22 bytes, with no comment."""
    end = len(data) - _END.size
    if end < 0 or data[end:end + 4] != b"PK\x05\x06" or _END.unpack_from(data, end)[7]:
        raise ValueError("the zip does not end with an end record without a comment")
    return end


def _local_entry(data: bytes, at: int, offset: int, flags: int, method: int, crc: int, compressed: int, size: int,
                 name: bytes) -> int:
    """Checks the entry whose local header must start at ``at`` (the one before it ends there) against
    its directory entry; where the next one starts."""
    if offset != at or at + _LOCAL.size > len(data) or _LOCAL.unpack_from(data, at)[0] != 0x04034B50:
        raise ValueError(f"zip entry {_shown(name)!r} does not follow the one before it")
    (_, _, local_flags, local_method, _, _, local_crc, local_compressed, local_size, name_length,
     extra_length) = _LOCAL.unpack_from(data, at)
    local_name = data[at + _LOCAL.size:at + _LOCAL.size + name_length]
    extra = data[at + _LOCAL.size + name_length:at + _LOCAL.size + name_length + extra_length]
    fields = _fields(extra, name)
    if (local_compressed, local_size) == (_MARK, _MARK):
        zip64 = [value for field, value in fields if field == 1]
        if len(zip64) != 1 or len(zip64[0]) < 16:
            raise ValueError(f"zip entry {_shown(name)!r}: its sizes are marked as in its zip64 field, which is "
                             "not one of 16 bytes or more")
        local_size, local_compressed = struct.unpack_from("<QQ", zip64[0])
    elif _MARK in (local_compressed, local_size):
        raise ValueError(f"zip entry {_shown(name)!r}: one size in its zip64 field, the other not")
    start = at + _LOCAL.size + name_length + extra_length
    if (local_flags != flags or flags & ~_FLAGS or local_method != method or method not in (_STORED, _DEFLATED)
            or local_crc != crc or (local_compressed, local_size) != (compressed, size)
            or (method == _STORED and compressed != size) or local_name != name or not _NAME.fullmatch(name)
            or start + compressed > len(data)):
        raise ValueError(f"zip entry {_shown(name)!r}: its local header and the zip's directory disagree, or it is "
                         "encrypted, has a data descriptor, is neither stored nor deflated, or has a name of other "
                         "characters than A-Z a-z 0-9 _ . -")
    return start + compressed


def _fields(extra: bytes, name: bytes) -> list[tuple[int, bytes]]:
    """The (id, value) fields of an extra block that they fill exactly."""
    fields, at = [], 0
    while at < len(extra):
        if at + 4 > len(extra) or at + 4 + struct.unpack_from("<H", extra, at + 2)[0] > len(extra):
            raise ValueError(f"zip entry {_shown(name)!r}: an extra field runs past its block")
        field, length = struct.unpack_from("<HH", extra, at)
        fields.append((field, extra[at + 4:at + 4 + length]))
        at += 4 + length
    return fields


def _content(body: bytes, method: int, size: int, crc: int, name: bytes) -> bytes:
    """The member's bytes: stored, or inflated from a deflate stream that ends at its compressed size
    and inflates to ``size`` bytes (never more); they hash to its CRC."""
    out = body
    if method == _DEFLATED:
        inflater = zlib.decompressobj(-zlib.MAX_WBITS)
        try:
            out = inflater.decompress(body, size + 1)
        except zlib.error as exc:
            raise ValueError(f"zip entry {_shown(name)!r} does not inflate: {exc}") from None
        if not inflater.eof or inflater.unused_data or inflater.unconsumed_tail or len(out) != size:
            raise ValueError(f"zip entry {_shown(name)!r}: its deflate stream does not end at its compressed size "
                             f"and inflate to its {size} bytes")
    if zlib.crc32(out) != crc:
        raise ValueError(f"zip entry {_shown(name)!r}: its bytes do not hash to its CRC")
    return out


def _shown(name: bytes) -> str:
    return name[:100].decode("latin-1")
