"""Building the package's C kernels on first use: compiled once per machine and cached.

The C sources ship with the package (nmt/model/fused_attention.c, nmt/inference/step_topk.c)
and are compiled by the system's C compiler (`$CC`, else `cc`; gcc or clang), `-O3` for
the CPU in use (`-march=native`; with ATEN_CPU_CAPABILITY=avx2 or default, as the AVX2 caps
set it, for that ISA only) and OpenMP (torch's own runtime, already loaded; `-fopenmp-simd`
where the compiler has no OpenMP runtime). A library is cached under `$XDG_CACHE_HOME/nmt`
(~/.cache/nmt), named by its source's name and a hash of source, header (simd.h), flags
and compiler, and written atomically, so concurrent processes never load a half-written
file. `load` then checks it (its parameter count, and its results against PyTorch's on a
small case); each kernel's module falls back to PyTorch's ops when it returns None.
"""

from __future__ import annotations

import array
import ctypes
import functools
import hashlib
import os
import platform
import shutil
import struct
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

from nmt.switches import switch

BUILD_ERRORS = (OSError, subprocess.SubprocessError, RuntimeError)  # what `build` raises
HEADER = Path(__file__).with_name("simd.h")  # what every kernel includes


def isa_flags() -> tuple[str, ...]:
    """Compiler flags for the vector ISA in use: the CPU's own (-march=native), or what
    ATEN_CPU_CAPABILITY caps torch's kernels at, so a capped run measures what a CPU of
    that class gets."""
    machine = platform.machine().lower()
    if machine not in ("x86_64", "amd64"):
        return ("-mcpu=native",) if machine in ("aarch64", "arm64") else ()
    cap = os.environ.get("ATEN_CPU_CAPABILITY", "").lower()
    if cap == "avx2":
        return ("-mavx2", "-mfma", "-mf16c")
    if cap == "default":
        return ()
    return ("-march=native",)


@functools.cache
def float_bits(value: float) -> int:
    """The float32 bit pattern of `value`, as the kernels read a float from their int64
    parameter blocks."""
    return struct.unpack("<i", struct.pack("<f", value))[0]


class Kernel:
    """One C kernel of the package: its library for the ISA in use, built, loaded and
    checked on first use (`load`, once per ISA per process), None when its NMT_* switch is
    "0" or it is unavailable. Both kernels are one of these (nmt/model/fused_attention.py,
    nmt/inference/step_topk.py)."""

    def __init__(self, source: Path, entry: str, params: int,
                 agrees: Callable[[ctypes.CDLL], bool], switch_name: str, what: str,
                 instead: str) -> None:
        self.source, self.entry, self.params, self.agrees = source, entry, params, agrees
        self.switch_name, self.what, self.instead = switch_name, what, instead
        self._loaded: dict[tuple[str, ...], ctypes.CDLL | None] = {}

    def library(self) -> ctypes.CDLL | None:
        """The library for the ISA in use (`isa_flags`), or None."""
        if switch(self.switch_name) == "0":
            return None
        isa = isa_flags()
        if isa not in self._loaded:
            self._loaded[isa] = load(self.source, isa, self.entry, self.params, self.agrees,
                                     self.what, self.instead)
        return self._loaded[isa]

    def enabled(self) -> bool:
        """Whether the kernel is wanted, built and checked here."""
        return self.library() is not None

    def forget(self) -> None:
        """Load again on next use (tests: a first use in another context)."""
        self._loaded.clear()


def load(source: Path, isa: tuple[str, ...], entry: str, params: int,
         agrees: Callable[[ctypes.CDLL], bool], what: str, instead: str) -> ctypes.CDLL | None:
    """The library of `source` built for `isa`, its function `entry` taking one int64
    parameter block of `params` entries (`entry`_params() says how many it reads), and
    `agrees(lib)` true; else None, said once on stderr: "`what` could not be built ...;
    `instead`" (what runs in its place)."""
    import torch  # lazily: building needs none of it

    try:
        path = build(source, isa)
    except BUILD_ERRORS as err:
        say(f"{what} could not be built ({err}); {instead}, slower on a CPU (install a C "
            "compiler, e.g. gcc, for it)")
        return None
    lib = ctypes.CDLL(str(path))
    getattr(lib, entry).argtypes = [ctypes.c_void_p]
    getattr(lib, entry).restype = ctypes.c_int
    getattr(lib, f"{entry}_params").restype = ctypes.c_int64
    if getattr(lib, f"{entry}_params")() != params:
        say(f"{path}: a kernel of another version; {instead}")
        return None
    try:  # whatever context the first use runs in (autocast in a bf16 validation)
        with torch.autocast("cpu", enabled=False), torch.inference_mode():
            ok = agrees(lib)
    except RuntimeError:
        ok = False
    if not ok:
        say(f"{what} disagrees with PyTorch here; {instead}")
        return None
    return lib


def build(source: Path, isa: tuple[str, ...]) -> Path:
    """The shared library of C file `source` for `isa`, compiled into the cache unless
    there already (once per source, flags and compiler). Raises one of BUILD_ERRORS, its
    message the compiler's last line, when no attempt builds."""
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        raise RuntimeError("no C compiler found (cc, gcc, or $CC)")
    text = source.read_bytes() + b"\0" + HEADER.read_bytes()
    attempts = [(*isa, "-fopenmp"), (*isa, "-fopenmp-simd"), ("-fopenmp-simd",)]
    errors = []
    for flags in attempts:
        key = hashlib.sha256(b"\0".join([text, compiler.encode(), *map(str.encode, flags)]))
        target = cache_dir() / f"{source.stem}-{key.hexdigest()[:16]}.so"
        if target.exists():
            return target
        with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
            built = Path(tmp) / target.name
            proc = subprocess.run([compiler, "-O3", *flags, "-shared", "-fPIC",
                                   f"-I{HEADER.parent}", "-o", str(built), str(source)],
                                  capture_output=True, text=True, timeout=120, check=False)
            if proc.returncode == 0:
                os.replace(built, target)  # atomic: another process sees all or nothing
                return target
            errors.append(proc.stderr.strip().splitlines()[-1:] or ["failed"])
    raise RuntimeError(f"{compiler}: {errors[0][0]}")


@functools.cache
def cache_dir() -> Path:
    """Where built kernels are kept: $XDG_CACHE_HOME/nmt (~/.cache/nmt), made if absent;
    a temporary directory when that cannot be written."""
    base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "nmt"
    try:
        base.mkdir(parents=True, exist_ok=True)
        if os.access(base, os.W_OK):
            return base
    except OSError:
        pass
    fallback = Path(tempfile.gettempdir()) / f"nmt-{os.getuid() if hasattr(os, 'getuid') else 0}"
    fallback.mkdir(parents=True, exist_ok=True)
    return fallback


def address(function: ctypes._CFuncPtr) -> int:
    """The address of a C function of a loaded library, for C code that calls it through
    a pointer (nmt/inference/native_step.c calls the other kernels and MKL that way)."""
    return ctypes.cast(function, ctypes.c_void_p).value or 0


def call_linear(entry: ctypes._CFuncPtr, op: int, x: int = 0, m: int = 0, k: int = 0,
                ldx: int = 0, w: int = 0, n: int = 0, bias: int = 0, y: int = 0, ldy: int = 0,
                threads: int = 1, scale: int = 0) -> int:
    """Call a linear kernel's C entry (nmt_amx_linear, nmt_avx2_linear) with its 12-entry
    parameter block, in the order both C sources (and native_step.c) read it; its status."""
    params = array.array("q", (op, x, m, k, ldx, w, n, bias, y, ldy, threads, scale))
    return entry(params.buffer_info()[0])


def say(text: str) -> None:
    """One line on stderr, for what the user would want to know about their setup."""
    print(f"nmt: {text}", file=sys.stderr)
