"""`.npy` bytes to arrays: common headers parsed directly, others through np.load (never unpickling)."""

from __future__ import annotations

import io
import math
import re

import numpy as np

_NPY_MAGIC = b"\x93NUMPY"
_NPY_HEADER_RE = re.compile(
    rb"\{'descr': '([<|>][a-z]\d+)', 'fortran_order': False, 'shape': \((|\d+,|\d+(?:, \d+)+)\), \} *\n"
)
# Plain little-endian numeric dtypes decoded directly; any other descr goes through np.load.
_NPY_DTYPES = {
    descr.encode(): np.dtype(descr)
    for descr in ("|b1", "|i1", "|u1", "<i2", "<u2", "<i4", "<u4", "<i8", "<u8", "<f2", "<f4", "<f8")
}
_NPY_MAX_HEADER = 10000  # np.load's own limit for a safe header


def decode_npy(data: bytes | memoryview) -> np.ndarray:
    """The array in `.npy` bytes; common headers are parsed directly, others go to np.load (never unpickling).

    Raises ValueError on truncated data or anything np.load(allow_pickle=False) refuses.
    """
    view = memoryview(data)
    if bytes(view[:6]) == _NPY_MAGIC and len(view) >= 12 and view[7] == 0 and view[6] in (1, 2, 3):
        start = 10 if view[6] == 1 else 12
        header_len = int.from_bytes(view[8:start], "little")
        match = None
        if header_len <= _NPY_MAX_HEADER and start + header_len <= len(view):
            match = _NPY_HEADER_RE.fullmatch(bytes(view[start : start + header_len]))
        if match is not None and (dtype := _NPY_DTYPES.get(match.group(1))) is not None:
            shape_text = match.group(2)
            shape = tuple(int(d) for d in shape_text.split(b",") if d.strip())
            count = math.prod(shape)
            body = view[start + header_len :]
            if len(body) < count * dtype.itemsize:
                raise ValueError(
                    f"truncated .npy: shape {shape} of {dtype} needs {count * dtype.itemsize} bytes, has {len(body)}"
                )
            return np.frombuffer(body, dtype=dtype, count=count).reshape(shape).copy()
    return np.load(io.BytesIO(view), allow_pickle=False)  # type: ignore[no-any-return]
