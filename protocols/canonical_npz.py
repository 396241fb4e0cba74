"""An .npz both device SDKs read alike: a deployed head, which the Python device reads here and the
Java device with ``Npz.read(data, max, true)``, and which must be one head, or one refusal, on both.

Neither hands the file to a general reader. The zip's members come from ``protocols.zip_layout``
(its rules, and ``ZipLayout.java``'s); each member is one ``*.npy`` array named once, parsed here by
the same rules as ``Npz.java``'s ``npy``:

* format version 1.0, 2.0 or 3.0; a header of at most 10,000 bytes (numpy's ``max_header_size``)
  that is exactly what numpy writes (:data:`CANONICAL_NPY_HEADER`: the dict's three keys in this
  order, one space after each colon and comma, the shape as Python's repr of a tuple of decimal
  integers, spaces, a newline). numpy parses a header as a Python literal, Java with regular
  expressions, and each took headers the other refused: ``(0x2, 3)`` and ``(2, 1_0)`` (Python's
  literals), ``(02, 3)``, ``(2,,3)``, ``(2)`` and a key named twice (Java's matching);
* C order, no dimension past 2^31 - 1 (a Java array's bound), and exactly the data the header
  declares: no byte more, none less.
"""

from __future__ import annotations

import io
import math
import re

import numpy as np

from protocols.files import NPY_HEADER_LOCK
from protocols.zip_layout import read_zip_members

_NPY_DIMENSION = r"(?:0|[1-9][0-9]*)"
CANONICAL_NPY_HEADER = re.compile(
    r"\{'descr': '[<>|=][a-zA-Z][0-9]{1,2}', 'fortran_order': (?:False|True), "
    rf"'shape': \((?:|{_NPY_DIMENSION},|{_NPY_DIMENSION}(?:, {_NPY_DIMENSION})+)\), \}} *\n")
MAX_NPY_HEADER_BYTES = 10_000       # numpy's max_header_size
MAX_DIMENSION = 2 ** 31 - 1         # a Java array's length


def read_canonical_npz(data: bytes, max_bytes: int) -> dict[str, np.ndarray]:
    """name -> array of every member of ``data`` (at most ``max_bytes`` together); ValueError naming
    what is not as the module requires."""
    arrays: dict[str, np.ndarray] = {}
    for member in read_zip_members(data, max_bytes):
        stem = member.name[:-4]
        if not member.name.endswith(".npy") or stem in arrays:
            raise ValueError(f".npz member {member.name[:100]!r}: every member must be one array named *.npy, "
                             "named once")
        try:
            arrays[stem] = _array(member.content)
        except ValueError as exc:
            raise ValueError(f".npz member {member.name[:100]!r} is not an .npy array as numpy writes one: {exc}") \
                from None
    return arrays


def _array(content: bytes) -> np.ndarray:
    stream = io.BytesIO(content)
    with NPY_HEADER_LOCK:
        version = np.lib.format.read_magic(stream)
        if version not in ((1, 0), (2, 0), (3, 0)):     # numpy reads any other as 2.0; Java refuses it
            raise ValueError(f"format version {version[0]}.{version[1]}: 1.0, 2.0 or 3.0 is what devices read")
        length_bytes = stream.read(2 if version == (1, 0) else 4)
        length = int.from_bytes(length_bytes, "little")
        if length > MAX_NPY_HEADER_BYTES:
            raise ValueError(f"a header of {length} bytes: at most {MAX_NPY_HEADER_BYTES} (numpy's max_header_size)")
        text = stream.read(length)
        if not CANONICAL_NPY_HEADER.fullmatch(text.decode("latin-1")):
            raise ValueError(f"its header {text[:120]!r} is not written as numpy writes one")
        read = np.lib.format.read_array_header_1_0 if version == (1, 0) else np.lib.format.read_array_header_2_0
        shape, fortran_order, dtype = read(io.BytesIO(length_bytes + text))
    if fortran_order:               # even where C order is the same bytes (one row)
        raise ValueError("an array in Fortran order")
    if any(n > MAX_DIMENSION for n in shape):
        raise ValueError(f"a dimension past 2^31 - 1 in {shape}")
    start = stream.tell()
    if dtype.hasobject or start + math.prod(shape) * dtype.itemsize != len(content):
        raise ValueError(f"its header declares {shape} of {dtype}, not its {len(content) - start:,} bytes of data")
    return np.frombuffer(content, dtype=dtype, offset=start, count=math.prod(shape)).reshape(shape).copy()
