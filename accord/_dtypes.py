"""Names for the dtype codes carried in message stamps."""
import numpy as np

from .buffers import BF16_CODE

_NAMES = {}


def dtype_name(code):
    if code == BF16_CODE:
        return "bfloat16"
    if not _NAMES:
        for t in np.sctypeDict.values():
            try:
                d = np.dtype(t)
            except TypeError:
                continue
            _NAMES.setdefault(d.num, d.name)
    return _NAMES.get(code, f"dtype#{code}")
