"""rltool's native kernels: one shared library built from `csrc/*.c` at install time.

`load()` returns the library as a `ctypes.CDLL`, or None when it is not built (a source tree used
without `pip install`) or `RLTOOL_NATIVE=0` is set; callers then use their torch implementation,
which computes the same bits. ctypes releases the GIL for the duration of each call, so worker
threads run native kernels in parallel. Each caller declares the argtypes of the functions it uses.
"""

from __future__ import annotations

import ctypes
import functools
import importlib.machinery
import logging
import os
from pathlib import Path

log = logging.getLogger(__name__)

LIBRARY_STEM = "_native"
DISABLE_ENV = "RLTOOL_NATIVE"


def library_path() -> Path | None:
    """The built library next to this module (setuptools names it with the ABI suffix)."""
    here = Path(__file__).parent
    for suffix in importlib.machinery.EXTENSION_SUFFIXES:
        path = here / (LIBRARY_STEM + suffix)
        if path.exists():
            return path
    return None


@functools.cache
def load() -> ctypes.CDLL | None:
    """The native library, or None (logged once) when disabled or not built."""
    if os.environ.get(DISABLE_ENV, "1") == "0":
        log.info("native kernels disabled (%s=0): using the torch implementations", DISABLE_ENV)
        return None
    path = library_path()
    if path is None:
        log.info("native kernels not built (run `pip install -e .`): using the torch "
                 "implementations")
        return None
    lib = ctypes.CDLL(str(path))
    log.info("native kernels: %s", path)
    return lib
