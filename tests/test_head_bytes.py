"""The Python and the Java device decide alike on the same head file bytes, however the file was
made (a review's findings, each a file below): a small deflated file declaring a huge shape (the
Python device allocated 3.3 GiB for a 1 MB file), one file holding two arrays of one name (numpy
and Java read different ones: two heads under one sha256), a shape whose product overflows a long
(Java accepted a (1, 3) head), a dimension past a long (Java's follower dropped the assignment with
no report), and arrays Java never reads (big-endian, integer, Fortran order, empty)."""

from __future__ import annotations

import io
import subprocess
import zipfile

import numpy as np
import pytest

import java_build
from protocols.envelope import EnvelopeError
from protocols.payloads.deployment import head_from_npz, head_npz

pytestmark = pytest.mark.skipif(java_build.missing() is not None, reason=str(java_build.missing()))


def npy(descr: str, shape: str, data: bytes, fortran: bool = False) -> bytes:
    """An .npy of exactly this header text (version 1.0), whatever it declares."""
    header = f"{{'descr': '{descr}', 'fortran_order': {fortran}, 'shape': {shape}, }}"
    header += " " * (-(10 + len(header) + 1) % 64) + "\n"
    return b"\x93NUMPY\x01\x00" + len(header).to_bytes(2, "little") + header.encode("latin1") + data


def npz(members: list[tuple[str, bytes]], deflate: bool = False) -> bytes:
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", zipfile.ZIP_DEFLATED if deflate else zipfile.ZIP_STORED) as z:
        for name, data in members:
            z.writestr(name, data)
    return buf.getvalue()


def npy_v2(array: np.ndarray) -> bytes:
    """numpy's own .npy of ``array`` with a version 2.0 header (a 4-byte header length)."""
    buf = io.BytesIO()
    np.lib.format.write_array(buf, array, version=(2, 0))
    return buf.getvalue()


def patched_directory(archive: bytes, shorten: str = "", leave_out: str = "") -> bytes:
    """``archive`` with its central directory saying ``shorten``'s member is 4 bytes shorter (its
    CRC that of the shorter bytes, so zipfile reads them as whole), or leaving ``leave_out`` out
    (its local entry still in the file, read front to back)."""
    import struct
    import zlib

    end = archive.rindex(b"PK\x05\x06")
    count, size, start = struct.unpack_from("<HII", archive, end + 10)
    entries, at = [], start
    while at < start + size:
        n, x, c = struct.unpack_from("<HHH", archive, at + 28)
        entries.append(bytearray(archive[at:at + 46 + n + x + c]))
        at += 46 + n + x + c
    kept = []
    for entry in entries:
        name = bytes(entry[46:46 + struct.unpack_from("<H", entry, 28)[0]]).decode()
        if name == leave_out:
            continue
        if name == shorten:
            offset, csize = struct.unpack_from("<I", entry, 42)[0], struct.unpack_from("<I", entry, 20)[0]
            n, x = struct.unpack_from("<HH", archive, offset + 26)
            data = archive[offset + 30 + n + x:offset + 30 + n + x + csize - 4]
            struct.pack_into("<III", entry, 16, zlib.crc32(data), csize - 4, csize - 4)
        kept.append(bytes(entry))
    directory = b"".join(kept)
    record = bytearray(archive[end:])
    struct.pack_into("<HHII", record, 8, len(kept), len(kept), len(directory), start)
    return archive[:start] + directory + bytes(record)


def bzip2_zip() -> bytes:
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", zipfile.ZIP_BZIP2) as z:
        z.writestr("weight.npy", npy("<f4", "(2, 3)", W.tobytes()))
        z.writestr(*BIAS)
    return buf.getvalue()


def zip_of(entries: list[tuple[str | bytes, bytes]], deflate_tail: bytes = b"", at: int = 0, flags: int = 0) -> bytes:
    """A zip written by hand: each (name, data) stored, or deflated with ``deflate_tail`` after its
    stream (inside its compressed size) when that is given; its offsets as if it began at byte ``at``
    of a file; ``flags`` in every header."""
    import struct
    import zlib

    local, directory = b"", b""
    for name, data in entries:
        name = name if isinstance(name, bytes) else name.encode()
        method, body = (0, data) if not deflate_tail else (8, (lambda c: c.compress(data) + c.flush())(
            zlib.compressobj(6, zlib.DEFLATED, -15)) + deflate_tail)
        fields = (20, flags, method, 0, 0x21, zlib.crc32(data), len(body), len(data), len(name), 0)
        directory += struct.pack("<IH" + "HHHHHIIIHH" + "HHHII", 0x02014B50, 20, *fields, 0, 0, 0, 0,
                                 at + len(local)) + name
        local += struct.pack("<I" + "HHHHHIIIHH", 0x04034B50, *fields) + name + body
    return local + directory + struct.pack("<IHHHHIIH", 0x06054B50, 0, 0, len(entries), len(entries), len(directory),
                                           at + len(local), 0)


def end_record_in_a_comment() -> bytes:
    """Another head (coef/intercept, 5 x 4), its directory and its end record inside the real end
    record's comment, that inner record's own comment (7 bytes) not reaching the file's end: zipfile
    took the inner one (the last signature), Java the real one: one file, two heads."""
    import struct

    real = zip_of([("weight.npy", npy("<f4", "(2, 3)", W.tobytes())), BIAS])
    inner = zip_of([("coef.npy", npy("<f4", "(5, 4)", bytes(80))), ("intercept.npy", npy("<f4", "(5,)", bytes(20)))],
                   at=len(real))
    inner = inner[:-2] + struct.pack("<H", 7)
    return real[:-2] + struct.pack("<H", len(inner)) + inner


def zip64_field_past_its_block() -> bytes:
    """numpy's savez output (its local sizes in a zip64 field of 16 bytes), that field said to be 17
    long: past the extra block. Java's stream reader skipped it and failed, zipfile read it."""
    import struct

    buf = io.BytesIO()
    np.savez(buf, weight=W, bias=B)
    data = bytearray(buf.getvalue())
    name_length = struct.unpack_from("<H", data, 26)[0]
    assert struct.unpack_from("<HH", data, 30 + name_length) == (1, 16)
    struct.pack_into("<H", data, 30 + name_length + 2, 17)
    return bytes(data)


W, B = np.arange(6, dtype=np.float32).reshape(2, 3), np.array([0.5, -1.0], np.float32)
BIAS = ("bias.npy", npy("<f4", "(2,)", B.tobytes()))
FILES = {
    "valid": head_npz(W, B),
    "valid float64": npz([("weight.npy", npy("<f8", "(2, 3)", W.astype("<f8").tobytes())),
                          ("bias.npy", npy("<f8", "(2,)", B.astype("<f8").tobytes()))]),
    "huge shape, deflated zeros": npz([("weight.npy", npy("<f4", "(4096, 16384)", bytes(4096 * 16384 * 4))),
                                       ("bias.npy", npy("<f4", "(4096,)", bytes(4096 * 4)))], deflate=True),
    "two arrays of one name": npz([("weight", npy("<f4", "(2, 3)", W.tobytes())),
                                   ("weight.npy", npy("<f4", "(2, 3)", (W + 1).tobytes())), BIAS]),
    "a member no array": npz([("weight.npy", npy("<f4", "(2, 3)", W.tobytes())), BIAS, ("notes.txt", b"x" * 64)]),
    "shape product past a long": npz([("weight.npy", npy("<f4", f"(1, {2 ** 61 + 3})", bytes(12))), BIAS]),
    "dimension past a long": npz([("weight.npy", npy("<f4", "(99999999999999999999, 1)", bytes(8))), BIAS]),
    "dimensions multiplying past a long": npz([("weight.npy", npy("<f4", f"({2 ** 40}, {2 ** 40})", bytes(8))), BIAS]),
    "big-endian": npz([("weight.npy", npy(">f4", "(2, 3)", W.astype(">f4").tobytes())), BIAS]),
    "integer": npz([("weight.npy", npy("<i4", "(2, 3)", W.astype("<i4").tobytes())), BIAS]),
    "Fortran order": npz([("weight.npy", npy("<f4", "(2, 3)", W.T.copy().tobytes(), fortran=True)), BIAS]),
    "empty": npz([("weight.npy", npy("<f4", "(2, 0)", b"")), BIAS]),
    # headers numpy's literal parser or Java's matching took and the other refused (a review's finding)
    "hexadecimal dimension": npz([("weight.npy", npy("<f4", "(0x2, 3)", W.tobytes())), BIAS]),
    "dimension with an underscore": npz([("weight.npy", npy("<f4", "(1_0, 3)", bytes(120))),
                                         ("bias.npy", npy("<f4", "(10,)", bytes(40)))]),
    "signed dimension": npz([("weight.npy", npy("<f4", "(+2, 3)", W.tobytes())), BIAS]),
    "dimension with a leading zero": npz([("weight.npy", npy("<f4", "(02, 3)", W.tobytes())), BIAS]),
    "two commas": npz([("weight.npy", npy("<f4", "(2,, 3)", W.tobytes())), BIAS]),
    "a tuple of one without its comma": npz([("weight.npy", npy("<f4", "(2, 3)", W.tobytes())),
                                             ("bias.npy", npy("<f4", "(2)", B.tobytes()))]),
    "a key named twice": npz([("weight.npy", b"\x93NUMPY\x01\x00" + (lambda h: len(h).to_bytes(2, "little") + h)(
        ("{'descr': '<f4', 'descr': '>f4', 'fortran_order': False, 'shape': (2, 3), }".ljust(117) + "\n").encode())
        + W.astype(">f4").tobytes()), BIAS]),
    "data past what the header declares": npz([("weight.npy", npy("<f4", "(2, 3)", W.tobytes() + bytes(4))), BIAS]),
    "valid, version 2.0 headers": npz([("weight.npy", npy_v2(W)), ("bias.npy", npy_v2(B))]),
    "valid, numpy's savez (sizes in zip64 fields)": (lambda buf: (np.savez(buf, weight=W, bias=B), buf.getvalue())[1])(
        io.BytesIO()),
    "valid, numpy's savez_compressed": (lambda buf: (np.savez_compressed(buf, weight=W, bias=B), buf.getvalue())[1])(
        io.BytesIO()),
    # what a review found both devices still decided apart
    "npy version 1.1": npz([("weight.npy", npy("<f4", "(2, 3)", W.tobytes()).replace(b"NUMPY\x01\x00", b"NUMPY\x01\x01")),
                            BIAS]),
    "a header past numpy's 10,000 bytes": npz([("weight.npy", b"\x93NUMPY\x01\x00" + (lambda h: len(h).to_bytes(2, "little") + h)(
        ("{'descr': '<f4', 'fortran_order': False, 'shape': (2, 3), }".ljust(10_047) + "\n").encode()) + W.tobytes()),
        BIAS]),
    "valid, another float array beside the head": npz([("weight.npy", npy("<f4", "(2, 3)", W.tobytes())), BIAS,
                                                       ("notes.npy", npy("<f8", "(1,)", bytes(8)))]),
    "an integer array beside the head": npz([("weight.npy", npy("<f4", "(2, 3)", W.tobytes())), BIAS,
                                             ("notes.npy", npy("<i4", "(1,)", bytes(4)))]),
    "a byte array beside the head": npz([("weight.npy", npy("<f4", "(2, 3)", W.tobytes())), BIAS,
                                         ("notes.npy", npy("|u1", "(1,)", bytes(1)))]),
    "a one-row array in Fortran order": npz([("weight.npy", npy("<f4", "(2, 3)", W.tobytes())),
                                             ("bias.npy", npy("<f4", "(2,)", B.tobytes(), fortran=True))]),
    "a version 2.0 member cut after its version": npz([("weight.npy", b"\x93NUMPY\x02\x00\x00\x00"), BIAS]),
    "the directory shorter than the member's data": patched_directory(npz([(
        "weight.npy", npy("<f4", "(2, 3)", W.tobytes()) + bytes(4)), BIAS]), shorten="weight.npy"),
    "valid, a zip written by hand": zip_of([("weight.npy", npy("<f4", "(2, 3)", W.tobytes())), BIAS]),
    "a CRC the directory and the local header disagree on": (lambda z: z[:z.rindex(b"PK\x01\x02") + 16] + bytes(4)
                                                             + z[z.rindex(b"PK\x01\x02") + 20:])(
        zip_of([("weight.npy", npy("<f4", "(2, 3)", W.tobytes())), BIAS])),
    "a deflate stream with bytes after its end": zip_of([("weight.npy", npy("<f4", "(2, 3)", W.tobytes())), BIAS],
                                                        deflate_tail=b"\x00\x00\x00\x00"),
    "a member named with a byte not ASCII": zip_of([("weight.npy", npy("<f4", "(2, 3)", W.tobytes())), BIAS,
                                                    (b"n\xf6tes.npy", npy("<f4", "(1,)", bytes(4)))]),
    "a bzip2 member": bzip2_zip(),
    "a byte after the end record": zip_of([("weight.npy", npy("<f4", "(2, 3)", W.tobytes())), BIAS]) + b"\x00",
    "a dimension past an int beside the head": npz([("weight.npy", npy("<f4", "(2, 3)", W.tobytes())), BIAS,
                                                    ("notes.npy", npy("<f4", "(0, 3000000000)", b""))]),
    "npy version 2.1": npz([("weight.npy", npy_v2(W).replace(b"NUMPY\x02\x00", b"NUMPY\x02\x01")), BIAS]),
    "a file past 64 MiB": head_npz(np.zeros((1, 16_777_151), np.float32), np.zeros(1, np.float32)),
    "NULs in members' names": zip_of([("weight.npy", npy("<f4", "(2, 3)", W.tobytes())), BIAS,
                                       (b"coef.npy\x00.npy", npy("<f4", "(5, 4)", bytes(80))),
                                       (b"intercept.npy\x00.npy", npy("<f4", "(5,)", bytes(20)))]),
    "an end record in the end record's comment": end_record_in_a_comment(),
    "a zip64 field past its extra block": zip64_field_past_its_block(),
    "flag 0x20 in every header": zip_of([("weight.npy", npy("<f4", "(2, 3)", W.tobytes())), BIAS], flags=0x20),
    "a member the directory leaves out": patched_directory(npz([("weight.npy", npy("<f4", "(2, 3)", W.tobytes())), BIAS,
                                                                 ("notes.npy", npy("<i4", "(1,)", bytes(4)))]),
                                                            leave_out="notes.npy"),
}


def python_decision(data: bytes) -> str:
    import hashlib

    try:
        weight, _ = head_from_npz(data, hashlib.sha256(data).hexdigest())
    except EnvelopeError as exc:
        return f"REFUSED {exc}"
    return f"OK {weight.shape[0]} {weight.shape[1]}"


def test_the_python_and_java_devices_take_and_refuse_the_same_head_files(tmp_path):
    paths = []
    for k, data in enumerate(FILES.values()):
        paths.append(tmp_path / f"{k}.npz")
        paths[-1].write_bytes(data)
    proc = subprocess.run(java_build.java_command("-cp", java_build.built(), "HeadBytes"),
                          input="\n".join(map(str, paths)) + "\n",
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    java = dict(zip(FILES, proc.stdout.splitlines()))
    python = {name: python_decision(data) for name, data in FILES.items()}
    verdicts = {name: (python[name].split()[0], java[name].split()[0]) for name in FILES}
    assert verdicts == {name: ("OK", "OK") if name.startswith("valid") else ("REFUSED", "REFUSED") for name in FILES}, \
        {name: (python[name][:120], java[name][:120]) for name in FILES}
    assert python["valid"] == java["valid"] == "OK 2 3" == python["valid float64"] == java["valid float64"]
    assert {name: python[name] for name in FILES if name.startswith("valid")} == \
        {name: java[name] for name in FILES if name.startswith("valid")}          # the same head, not only taken
