"""Builds rltool's one native library, `rltool._native`, from every `csrc/*.c`.

Plain C functions called through ctypes (`rltool/native.py`); no Python C-API is used, so the
file is an ordinary shared library that only borrows setuptools' extension build for its
compiler flags and install location. Project metadata lives in pyproject.toml.
"""

from glob import glob

from setuptools import Extension, setup

setup(ext_modules=[Extension("rltool._native", sources=sorted(glob("csrc/*.c")),
                             extra_compile_args=["-O3", "-std=c11"])])
