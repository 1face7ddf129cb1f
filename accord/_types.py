"""Type aliases used in the public signatures (documentation and type checkers only).

Nothing here is enforced at run time: every function checks its arguments
itself and raises TypeError or ValueError before any byte moves.
"""
from datetime import timedelta
from typing import Any, Union

# A numpy array, a CPU torch.Tensor, or any object exporting a writable buffer
# (bytearray, memoryview, array.array). Inputs that are only read may be read-only.
Tensor = Any

# Seconds (int or float) or a datetime.timedelta; None: the group's timeout.
Timeout = Union[float, timedelta, None]
