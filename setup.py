"""Builds the optional native extensions ``vllm_accel._C_sam`` (suffix automaton) and
``vllm_accel._C_kivi`` (KIVI decode attention on CPU).

Package metadata lives in pyproject.toml; this file only declares the
extension.  The extension is optional: without a C++17 compiler or pybind11, or
if compilation fails, the build prints a warning and the package installs
without it (``vllm_accel.spec_decode.suffix_automaton`` then uses its
pure-Python fallback, the KIVI backend its torch path).  Set ``VLLM_ACCEL_REQUIRE_NATIVE=1`` to turn such a
failure into an error (e.g. in CI jobs that must test the native code).
"""

import os
import sys

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

SAM_DIR = os.path.join("csrc", "suffix_automaton")
KIVI_DIR = os.path.join("csrc", "kivi")


class OptionalBuildExt(build_ext):
    """build_ext that downgrades a failed native build to a warning."""

    def run(self):
        try:
            super().run()
        except Exception as exc:  # e.g. no usable compiler toolchain at all
            self._skip("the native extensions", exc)
            self.extensions = []

    def build_extensions(self):
        built = []
        for ext in self.extensions:
            try:
                self._configure(ext)
                self.build_extension(ext)
                built.append(ext)
            except Exception as exc:  # no compiler, no pybind11, compile error
                self._skip(ext.name, exc)
        # Later steps (in-place copy, wheel contents) only see what was built.
        self.extensions = built

    def _configure(self, ext):
        import pybind11

        ext.include_dirs.append(pybind11.get_include())
        if self.compiler.compiler_type == "msvc":
            ext.extra_compile_args += ["/O2", "/std:c++17", "/EHsc"]
        else:
            ext.extra_compile_args += ["-O3", "-std=c++17", "-fvisibility=hidden"]

    @staticmethod
    def _skip(what, exc):
        if os.environ.get("VLLM_ACCEL_REQUIRE_NATIVE") == "1":
            raise exc
        print(
            f"WARNING: could not build {what} ({type(exc).__name__}: {exc}); "
            "installing without it, the pure-Python fallback will be used.",
            file=sys.stderr,
        )


setup(
    ext_modules=[
        Extension(
            "vllm_accel._C_sam",
            sources=[
                os.path.join(SAM_DIR, "suffix_automaton.cpp"),
                os.path.join(SAM_DIR, "bindings.cpp"),
            ],
            depends=[os.path.join(SAM_DIR, "suffix_automaton.hpp")],
            language="c++",
        ),
        Extension(
            "vllm_accel._C_kivi",
            sources=[os.path.join(KIVI_DIR, "kivi_decode.cpp")],
            extra_compile_args=["-fopenmp"] if sys.platform.startswith("linux") else [],
            extra_link_args=["-fopenmp"] if sys.platform.startswith("linux") else [],
            language="c++",
        ),
    ],
    cmdclass={"build_ext": OptionalBuildExt},
)
