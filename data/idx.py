"""Reader for the IDX format used by MNIST and Fashion-MNIST.

The format is tiny (a 4-byte magic number, big-endian dimension sizes, then raw data), so it is
parsed here directly with numpy rather than through torchvision, which wants the files unpacked
into its own directory layout first. Every structural fact is checked, so a truncated or foreign
file fails with a message naming it instead of producing garbage tensors.
"""

from __future__ import annotations

import gzip
import math
import zlib
from pathlib import Path

import numpy as np

from data.errors import CorruptDataError

_DTYPES: dict[int, np.dtype] = {
    0x08: np.dtype(np.uint8),
    0x09: np.dtype(np.int8),
    0x0B: np.dtype(">i2"),
    0x0C: np.dtype(">i4"),
    0x0D: np.dtype(">f4"),
    0x0E: np.dtype(">f8"),
}
"""IDX type codes (third magic byte) and the numpy dtypes they denote."""


def read_idx(path: Path, fix: str = "replace it with an intact copy") -> np.ndarray:
    """Read an IDX file, gzip-compressed if its name ends in ``.gz``.

    Args:
        path: The file to read.
        fix: The remedy quoted in the error message if the file is corrupt.

    Returns:
        An array with the file's dimensions and native-endian dtype.

    Raises:
        CorruptDataError: The file cannot be decompressed, its magic number is wrong, or its size
            does not match the dimensions in its header.
    """

    def corrupt(problem: str) -> CorruptDataError:
        return CorruptDataError(path, problem, fix)

    try:
        if path.suffix == ".gz":
            with gzip.open(path, "rb") as handle:
                raw = handle.read()
        else:
            raw = path.read_bytes()
    except (OSError, EOFError, zlib.error) as exc:
        raise corrupt(f"cannot be read or decompressed ({exc})") from exc

    if len(raw) < 4:
        raise corrupt(f"is {len(raw)} bytes long, too short for an IDX header")
    zero0, zero1, type_code, ndim = raw[0], raw[1], raw[2], raw[3]
    if zero0 != 0 or zero1 != 0 or type_code not in _DTYPES or ndim == 0:
        raise corrupt(f"has IDX magic number 0x{raw[:4].hex()}, not 0x0000<type><ndim>")
    header = 4 + 4 * ndim
    if len(raw) < header:
        raise corrupt(f"header declares {ndim} dimensions but the file ends inside it")
    shape = tuple(int(d) for d in np.frombuffer(raw, dtype=">u4", count=ndim, offset=4))
    dtype = _DTYPES[type_code]
    # Python ints: np.prod wraps around (65536**4 == 0 in int64) and would accept the file
    expected = header + math.prod(shape) * dtype.itemsize
    if len(raw) != expected:
        raise corrupt(f"header promises shape {shape} ({expected} bytes) but has {len(raw)} bytes")
    data = np.frombuffer(raw, dtype=dtype, offset=header).reshape(shape)
    return data.astype(dtype.newbyteorder("="), copy=True)
