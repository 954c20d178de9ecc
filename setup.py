"""Build of the compiled code: the kernels (kvstore_lazy/store/kernels*.c), the protocol fast path
(kvstore_lazy/protocol/_fast*.c) and the transport's whole-message calls (kvstore_lazy/transport/_zmqmsg.c);
everything else is in pyproject.toml.

Each library is built from several C units, one concern each; the first unit of each (kernels.c, _fast.c,
_zmqmsg.c) lists them and says what each owns. LIBRARIES below names every source of every library, and the
loaders (store/kernels.py, protocol/fast.py, transport/zmq_van.py) name the same ones.

``pip install .``, ``pip wheel .`` and ``pip install -e .`` compile the kernels into ``kvstore_lazy/store/_kernels.so``
(in place for an editable install), which kvstore_lazy.store.kernels loads with ctypes: a plain C library that uses
no Python API, so it is named without an interpreter suffix and the wheel is tagged ``py3-none-<platform>``, one
wheel for every supported CPython.

The float flags matter: -ffp-contract=off (no fused multiply-adds) and no -ffast-math keep the kernels'
arithmetic bit-identical to MXNet's (tests/test_optimizers.py). Every unit is compiled with them.

``_fast`` is a CPython extension module (the per-message fast path: PBMeta codec, request checks, row gathers,
uniform initial values, updates through the kernels), built against the limited API of CPython 3.11
(``Py_LIMITED_API`` in ``_fast.h``) and named ``_fast.so`` (a suffix every CPython imports): the one build loads in
every CPython >= 3.11 (``requires-python``), so the wheel stays one wheel for all of them. It takes arrays through
the buffer protocol (no numpy headers). ``_zmqmsg`` (``kvstore_lazy/transport/_zmqmsg.so``) is built the same way:
the one place that calls libzmq (through the addresses zmq_van.py hands it), so protocol/ holds no socket code.

Every library records the SHA-256 of all its sources, headers included (``kernels_digest()``, ``_fast.digest()``,
``_zmqmsg.digest()``), and its loader compares it with the sources beside it, so an in-place build older than any
one of them is refused at import instead of being used. The digest (``sources_digest``): SHA-256 over the files in
the order of their names, each as its name, a NUL, its length in decimal, a NUL and its bytes.
"""
import hashlib
from pathlib import Path

from setuptools import Extension, setup
from setuptools.command.bdist_wheel import bdist_wheel
from setuptools.command.build_ext import build_ext
from setuptools.command.build_py import build_py

ROOT = Path(__file__).parent
STORE, PROTOCOL, TRANSPORT = "kvstore_lazy/store", "kvstore_lazy/protocol", "kvstore_lazy/transport"
# library -> (its C units, its headers), as the loaders name them
LIBRARIES = {
    "kvstore_lazy.store._kernels": (
        [f"{STORE}/{name}.c" for name in ("kernels", "kernels_index", "kernels_rows", "kernels_optim",
                                          "kernels_normal", "kernels_io", "kernels_records", "kernels_catchup",
                                          "kernels_runs")],
        [f"{STORE}/kernels.h"]),
    "kvstore_lazy.protocol._fast": (
        [f"{PROTOCOL}/{name}.c" for name in ("_fast", "_fast_pbmeta", "_fast_checks", "_fast_rows", "_fast_uniform",
                                             "_fast_updates", "_fast_float")],
        [f"{PROTOCOL}/_fast.h", f"{PROTOCOL}/_fast_uniform.h"]),
    "kvstore_lazy.transport._zmqmsg": ([f"{TRANSPORT}/_zmqmsg.c"], []),
}
FLOAT_FLAGS = ["-O3", "-g0", "-std=c99", "-ffp-contract=off", "-fno-math-errno"]


def sources_digest(paths: list[str]) -> str:
    """The digest a library records of its sources (the loaders compute the same over the files beside them)."""
    digest = hashlib.sha256()
    for path in sorted((ROOT / p for p in paths), key=lambda p: p.name):
        data = path.read_bytes()
        digest.update(b"%s\0%d\0" % (path.name.encode(), len(data)) + data)
    return digest.hexdigest()


def extension(name: str, macro: str, **options) -> Extension:
    units, headers = LIBRARIES[name]
    return Extension(name, units, depends=headers, define_macros=[(macro, f'"{sources_digest(units + headers)}"')],
                     extra_compile_args=FLOAT_FLAGS, **options)


class BuildPlainLibrary(build_ext):
    """``_kernels.so``, not ``_kernels.cpython-311-x86_64-linux-gnu.so``: any CPython loads it through ctypes (and
    ``_fast.so`` and ``_zmqmsg.so``, of the stable ABI, any CPython >= 3.11 imports)."""

    def get_ext_filename(self, fullname: str) -> str:
        return fullname.replace(".", "/") + ".so"

    def build_extensions(self) -> None:
        # no run path into the build machine's Python (the library needs libc only)
        self.compiler.linker_so = [a for a in self.compiler.linker_so if not a.startswith("-Wl,-rpath")]
        super().build_extensions()


class InterpreterIndependentWheel(bdist_wheel):
    def get_tag(self) -> tuple[str, str, str]:
        return ("py3", "none", super().get_tag()[2])


class BuildPyWithPatches(build_py):
    """The mxnet patches (the checkout's top-level patches/*.diff) go into the wheel as
    kvstore_lazy/worker/patches/, where ``kvstore-lazy patch`` (kvstore_lazy.worker.patch) reads them when
    installed; MANIFEST.in puts them in the sdist."""

    def run(self) -> None:
        super().run()
        target = Path(self.build_lib) / "kvstore_lazy" / "worker" / "patches"
        self.mkpath(str(target))
        for diff in sorted((ROOT / "patches").glob("*.diff")):
            self.copy_file(str(diff), str(target / diff.name))


setup(
    ext_modules=[extension("kvstore_lazy.store._kernels", "KERNELS_DIGEST", libraries=["m"]),
                 extension("kvstore_lazy.protocol._fast", "FAST_DIGEST"),
                 extension("kvstore_lazy.transport._zmqmsg", "ZMQMSG_DIGEST")],
    cmdclass={"build_ext": BuildPlainLibrary, "build_py": BuildPyWithPatches,
              "bdist_wheel": InterpreterIndependentWheel},
)
