"""The one zip layout both device SDKs take for a file they both read (a deployed head).

zipfile (the Python device, through numpy) reads a zip from its end record and central directory;
``java.util.zip.ZipInputStream`` (the Java device, ``Npz.java``) reads the local headers front to
back. A zip in which the two disagree — a size, a CRC, a compression method or a name that differs
between a local header and the directory, an entry the directory leaves out, an end record inside
another's comment, bytes after a deflate stream — was one head to one device and another head (or a
refusal) to the other, under one sha256 (two review helpers crafted such files). So a head is taken
only when its layout leaves nothing to choose, checked here and by ``Npz.java`` (``canonical``) with
the same rules, in this order:

1. the end record is the last one whose comment reaches the file's end exactly; one disk; its
   directory ends where the record starts;
2. the directory's entries, in order, point at local headers that lie back to back from the file's
   first byte, the last one's data ending where the directory starts;
3. each entry's local header and directory entry agree on flags, method, CRC, sizes and name; no
   encryption, no data descriptor; stored or deflated; a stored entry's two sizes equal; names ASCII;
4. sizes are in the 32-bit fields, except a local header whose two sizes are both 0xFFFFFFFF and
   whose one zip64 field (id 1) holds them (numpy's ``savez`` writes them so); the directory holds
   none;
5. a deflated entry's stream ends exactly at its compressed size and inflates to its size.

What numpy (``savez``, ``savez_compressed``), zipfile and ``head_npz`` write to a file or a buffer
follows these rules; ``tests/test_head_bytes.py`` holds both devices to one verdict.
"""

from __future__ import annotations

import struct
import zlib
from dataclasses import dataclass

_LOCAL = struct.Struct("<IHHHHHIIIHH")              # 30 bytes, signature 0x04034b50
_CENTRAL = struct.Struct("<IHHHHHHIIIHHHHHII")      # 46 bytes, signature 0x02014b50
_END = struct.Struct("<IHHHHIIH")                   # 22 bytes, signature 0x06054b50
_MARK = 0xFFFFFFFF                                  # a size held in the zip64 field
_STORED, _DEFLATED = 0, 8
_ENCRYPTED, _DESCRIPTOR = 0x0001, 0x0008


@dataclass(frozen=True)
class Entry:
    name: str
    method: int
    size: int
    data: bytes             # the entry's stored or compressed bytes


def check_zip_layout(data: bytes) -> list[Entry]:
    """The entries of ``data``, in order, when its layout follows the module's rules; ValueError
    naming the first rule it breaks."""
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
        if at > end or _MARK in (compressed, size, offset):
            raise ValueError("a zip directory entry is cut short, or holds its sizes in a zip64 field")
        entry, local_at = _local_entry(data, local_at, offset, flags, method, crc, compressed, size, name)
        entries.append(entry)
    if at != end or local_at != directory_at:
        raise ValueError("the zip holds more than its directory lists")
    return entries


def _end_record(data: bytes) -> int:
    """Where the end record is: the last whose comment reaches the file's end exactly (Java's rule;
    zipfile takes the last signature whatever its comment says)."""
    for end in range(len(data) - _END.size, max(-1, len(data) - _END.size - 0xFFFF - 1), -1):
        if data[end:end + 4] == b"PK\x05\x06" and _END.unpack_from(data, end)[7] == len(data) - end - _END.size:
            return end
    raise ValueError("no zip end record closes the file")


def _local_entry(data: bytes, at: int, offset: int, flags: int, method: int, crc: int, compressed: int, size: int,
                 name: bytes) -> tuple[Entry, int]:
    """The entry whose local header must start at ``at`` (the one before it ends there) and agree with
    its directory entry; and where the next one starts."""
    if offset != at or at + _LOCAL.size > len(data) or _LOCAL.unpack_from(data, at)[0] != 0x04034B50:
        raise ValueError(f"zip entry {_shown(name)!r} does not follow the one before it")
    (_, _, local_flags, local_method, _, _, local_crc, local_compressed, local_size, name_length,
     extra_length) = _LOCAL.unpack_from(data, at)
    local_name = data[at + _LOCAL.size:at + _LOCAL.size + name_length]
    extra = data[at + _LOCAL.size + name_length:at + _LOCAL.size + name_length + extra_length]
    if (local_compressed, local_size) == (_MARK, _MARK):
        local_size, local_compressed = _zip64_sizes(extra)
    elif _MARK in (local_compressed, local_size):
        raise ValueError(f"zip entry {_shown(name)!r}: one size in its zip64 field, the other not")
    start = at + _LOCAL.size + name_length + extra_length
    if (local_flags != flags or flags & (_ENCRYPTED | _DESCRIPTOR) or local_method != method
            or method not in (_STORED, _DEFLATED) or local_crc != crc
            or (local_compressed, local_size) != (compressed, size)
            or (method == _STORED and compressed != size) or local_name != name or not name.isascii()
            or start + compressed > len(data)):
        raise ValueError(f"zip entry {_shown(name)!r}: its local header and the zip's directory disagree, or it is "
                         "encrypted, has a data descriptor, is neither stored nor deflated, or has a name not ASCII")
    body = data[start:start + compressed]
    if method == _DEFLATED:
        _check_deflate(body, size, name)
    return Entry(name.decode("ascii"), method, size, body), start + compressed


def _zip64_sizes(extra: bytes) -> tuple[int, int]:
    """(size, compressed size) of a local header's one zip64 field (id 1, at least 16 bytes)."""
    found, at = [], 0
    while at + 4 <= len(extra):
        field, length = struct.unpack_from("<HH", extra, at)
        if field == 1:
            found.append(extra[at + 4:at + 4 + length])
        at += 4 + length
    if len(found) != 1 or len(found[0]) < 16:
        raise ValueError("a zip entry's sizes are marked as in its zip64 field, which is not one of 16 bytes or more")
    return struct.unpack_from("<QQ", found[0])


def _check_deflate(body: bytes, size: int, name: bytes) -> None:
    """The deflate stream ends at the entry's last byte and inflates to ``size`` bytes (what Java's
    reader holds it to), inflating no more than that."""
    inflater = zlib.decompressobj(-zlib.MAX_WBITS)
    try:
        out = inflater.decompress(body, size + 1)
    except zlib.error as exc:
        raise ValueError(f"zip entry {_shown(name)!r} does not inflate: {exc}") from None
    if not inflater.eof or inflater.unused_data or inflater.unconsumed_tail or len(out) != size:
        raise ValueError(f"zip entry {_shown(name)!r}: its deflate stream does not end at its compressed size "
                         f"and inflate to its {size} bytes")


def _shown(name: bytes) -> str:
    return name[:100].decode("latin-1")
