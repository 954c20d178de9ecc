"""Build of the compiled kernels (kvstore_lazy/store/kernels.c) and of the protocol fast path
(kvstore_lazy/protocol/_fast.c); everything else is in pyproject.toml.

``pip install .``, ``pip wheel .`` and ``pip install -e .`` compile kernels.c into ``kvstore_lazy/store/_kernels.so``
(in place for an editable install), which kvstore_lazy.store.kernels loads with ctypes: a plain C library that uses
no Python API, so it is named without an interpreter suffix and the wheel is tagged ``py3-none-<platform>``, one
wheel for every supported CPython. The library records the SHA-256 of the source it was built from
(``kernels_digest()``), so an in-place build older than kernels.c is refused at import instead of being used.

The float flags matter: -ffp-contract=off (no fused multiply-adds) and no -ffast-math keep the kernels'
arithmetic bit-identical to MXNet's (tests/test_optimizers.py).

``_fast.c`` is a CPython extension module (the per-message fast path: PBMeta codec, row gathers, uniform initial
values), built against the limited API of CPython 3.11 (``Py_LIMITED_API`` in the source) and named ``_fast.so``
(a suffix every CPython imports): the one build loads in every CPython >= 3.11 (``requires-python``), so the wheel
stays one wheel for all of them. It takes
arrays through the buffer protocol (no numpy headers) and records its source's SHA-256 too (``_fast.digest()``,
checked by kvstore_lazy.protocol.fast).
"""
import hashlib
from pathlib import Path

from setuptools import Extension, setup
from setuptools.command.bdist_wheel import bdist_wheel
from setuptools.command.build_ext import build_ext

SOURCE = "kvstore_lazy/store/kernels.c"
DIGEST = hashlib.sha256((Path(__file__).parent / SOURCE).read_bytes()).hexdigest()
FAST_SOURCE = "kvstore_lazy/protocol/_fast.c"
FAST_DIGEST = hashlib.sha256((Path(__file__).parent / FAST_SOURCE).read_bytes()).hexdigest()
FLOAT_FLAGS = ["-O3", "-g0", "-std=c99", "-ffp-contract=off", "-fno-math-errno"]


class BuildPlainLibrary(build_ext):
    """``_kernels.so``, not ``_kernels.cpython-311-x86_64-linux-gnu.so``: any CPython loads it through ctypes (and
    ``_fast.so``, of the stable ABI, any CPython >= 3.11 imports)."""

    def get_ext_filename(self, fullname: str) -> str:
        return fullname.replace(".", "/") + ".so"

    def build_extensions(self) -> None:
        # no run path into the build machine's Python (the library needs libc only)
        self.compiler.linker_so = [a for a in self.compiler.linker_so if not a.startswith("-Wl,-rpath")]
        super().build_extensions()


class InterpreterIndependentWheel(bdist_wheel):
    def get_tag(self) -> tuple[str, str, str]:
        return ("py3", "none", super().get_tag()[2])


setup(
    ext_modules=[Extension(
        "kvstore_lazy.store._kernels", [SOURCE],
        define_macros=[("KERNELS_DIGEST", f'"{DIGEST}"')],
        extra_compile_args=FLOAT_FLAGS,
        libraries=["m"]),
        Extension(
        "kvstore_lazy.protocol._fast", [FAST_SOURCE],
        define_macros=[("FAST_DIGEST", f'"{FAST_DIGEST}"')],
        extra_compile_args=FLOAT_FLAGS)],
    cmdclass={"build_ext": BuildPlainLibrary, "bdist_wheel": InterpreterIndependentWheel},
)
