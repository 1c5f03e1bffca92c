"""Builds nmt's C kernels at install: each kernel once per ISA level it has
(nmt/kernels/levels.py), as plain shared libraries inside the package, loaded with ctypes by
nmt/kernels/__init__.py, which picks the level this CPU runs. A kernel or level that does not
compile (no C compiler, another architecture) is left out with a warning and the install goes
on: the library then runs PyTorch's ops in its place (`nmt doctor` says which). Everything
else about the package is in pyproject.toml.
"""

from __future__ import annotations

import os
import platform
import runpy
import shutil
import subprocess
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext
from setuptools.errors import CompileError

KERNELS_DIR = Path("nmt") / "kernels"  # relative: setuptools wants project paths
LEVELS_DATA = runpy.run_path(str(KERNELS_DIR / "levels.py"))
X86 = platform.machine().lower() in ("x86_64", "amd64", "i686", "x86")


def kernel_extensions() -> list[Extension]:
    """One Extension per kernel and level (other architectures: the baseline only), optional:
    setuptools warns and goes on where one fails."""
    return [Extension(f"nmt.kernels.{name}_{level}", [str(KERNELS_DIR / f"{name}.c")],
                      depends=[str(KERNELS_DIR / "simd.h")], optional=True,
                      extra_compile_args=list(LEVELS_DATA["LEVELS"][level][0]))
            for name, levels in LEVELS_DATA["KERNELS"].items() for level in levels
            if X86 or level not in LEVELS_DATA["X86_ONLY"]]


class BuildKernels(build_ext):
    """build_ext for libraries that are not Python modules: `cc -O3 <level> -fopenmp -shared`
    (then `-fopenmp-simd` where the compiler has no OpenMP), named <kernel>_<level>.so, the
    compiler `$CC` else `cc`; several at once."""

    def get_ext_filename(self, fullname: str) -> str:
        return os.path.join(*fullname.split(".")) + ".so"

    def build_extensions(self) -> None:
        with ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:
            list(pool.map(self._build_optional, self.extensions))

    def _build_optional(self, ext: Extension) -> None:
        try:
            self.build_extension(ext)
        except CompileError as err:
            print(f"nmt: kernel {ext.name} not built ({err}); PyTorch's ops run in its place")

    def build_extension(self, ext: Extension) -> None:
        target = Path(self.get_ext_fullpath(ext.name))
        target.parent.mkdir(parents=True, exist_ok=True)
        compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
        if compiler is None:
            raise CompileError("no C compiler found (cc, gcc, or $CC)")
        source = Path(ext.sources[0])
        last = "failed"
        for openmp in ("-fopenmp", "-fopenmp-simd"):
            with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
                built = Path(tmp) / target.name
                proc = subprocess.run(
                    [compiler, "-O3", *ext.extra_compile_args, openmp, "-shared", "-fPIC",
                     f"-I{source.parent}", "-o", str(built), str(source)],
                    capture_output=True, text=True, check=False)
                if proc.returncode == 0:
                    os.replace(built, target)
                    return
                last = (proc.stderr.strip().splitlines() or ["failed"])[-1]
        raise CompileError(f"{compiler}: {last}")


setup(ext_modules=kernel_extensions(), cmdclass={"build_ext": BuildKernels})
