"""Everything about the package is in pyproject.toml; this file only declares the
optional C helpers: the shared-memory ring's (accord/transport/ring_core.c),
large local copies' (accord/copy_core.c) and 16-bit float reductions'
(accord/halves_core.c).

`optional=True`: where one cannot be compiled (no C compiler, no Python headers)
setuptools warns and installs the package without it, and accord runs its
pure-Python path (accord/transport/ring_helper.py, accord/localcopy.py and
accord/halves.py choose at import).
"""
from setuptools import Extension, setup

setup(ext_modules=[
    # both write with streaming stores through accord/stream_store.h
    Extension("accord.transport.ring_core", ["accord/transport/ring_core.c"],
              depends=["accord/stream_store.h"], optional=True, extra_compile_args=["-O2"]),
    Extension("accord.copy_core", ["accord/copy_core.c"],
              depends=["accord/stream_store.h"], optional=True, extra_compile_args=["-O2"]),
    # IEEE float arithmetic, as numpy's: no fast-math, no contraction into FMAs; -O3
    # vectorizes the portable loops (AVX2's and F16C's are written out, chosen at import)
    Extension("accord.halves_core", ["accord/halves_core.c"],
              optional=True, extra_compile_args=["-O3", "-ffp-contract=off"]),
])
