"""The wheel hook (everything else is in pyproject.toml).

    RLK_WHEEL_CUDA_FFI=1 python -m build --wheel --no-isolation

on a machine with nvcc and the `cuda` extra builds the SM90 library (or
takes it from the cache: ``python -m cuda_ffi.build``) into the wheel's
``cuda_ffi/prebuilt/``, so a team builds once and installs everywhere. Such
a wheel is tagged for the platform (the library is x86-64 Linux machine
code); it runs on sm_90 GPUs with a driver for the CUDA release it was
compiled with, against the jaxlib whose XLA FFI header it was compiled with
(checked at load: cuda_ffi.build._prebuilt_dir; another jaxlib builds from
source as usual). Without the variable the wheel is pure Python, and the
library is built on first use.
"""

import os
import pathlib

from setuptools import Distribution, setup
from setuptools.command.build_py import build_py

try:
  from setuptools.command.bdist_wheel import bdist_wheel
except ImportError:  # older setuptools: the wheel package's
  from wheel.bdist_wheel import bdist_wheel

WITH_LIBRARY = os.environ.get("RLK_WHEEL_CUDA_FFI") == "1"


class BuildPyWithLibrary(build_py):

  def run(self):
    super().run()
    if WITH_LIBRARY:
      from cuda_ffi import build
      into = pathlib.Path(self.build_lib) / "cuda_ffi" / "prebuilt"
      build.write_prebuilt(into, log=lambda line: self.announce(line, 2))


class LibraryDistribution(Distribution):

  def has_ext_modules(self):
    # The library is machine code: a platform wheel, files at its root.
    return WITH_LIBRARY


class PlatformWheel(bdist_wheel):

  def get_tag(self):
    python, abi, plat = super().get_tag()
    # ctypes loads the library: any Python 3, one platform.
    return ("py3", "none", plat) if WITH_LIBRARY else (python, abi, plat)


setup(distclass=LibraryDistribution,
      cmdclass={"build_py": BuildPyWithLibrary, "bdist_wheel": PlatformWheel})
