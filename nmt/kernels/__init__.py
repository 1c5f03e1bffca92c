"""nmt's C kernels: built at install for each ISA level (setup.py, levels.py), chosen here at
run time for the CPU in use, as torch's ATen and numpy dispatch.

A kernel's library is nmt/kernels/<name>_<level>.so. The loader takes the last level of the
kernel's list (levels.KERNELS) that was built, that this CPU reports in /proc/cpuinfo and that
the ISA caps allow (ATEN_CPU_CAPABILITY and ONEDNN_MAX_CPU_ISA, as `make test`'s AVX2 pass sets
them), then checks the library: its parameter count, and its results against PyTorch's on a
small case (`agrees`). A library built for a level this CPU lacks is never loaded, so one
package serves every CPU it is copied to. Where no library applies (none built, another
architecture, the check failed, or NMT_KERNELS=0) the kernel's module runs PyTorch's ops;
nothing is printed, `nmt doctor` says which and why. Nothing is compiled or written at run time.
"""

from __future__ import annotations

import array
import ctypes
import functools
import os
import platform
import struct
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from nmt.cores import cpu_info
from nmt.kernels.levels import KERNELS, LEVELS, X86_ONLY
from nmt.switches import switch

HERE = Path(__file__).parent

# The caps' values (upper case: ATen's default and avx2, oneDNN's ISA names) and the highest
# level each leaves; any other value (ATen's avx512, oneDNN's AMX ones) caps nothing of ours.
_CAPS = {"DEFAULT": "baseline", "SSE41": "baseline", "AVX": "baseline", "AVX2": "avx2",
         "AVX2_VNNI": "avx2_vnni", "AVX2_VNNI_2": "avx2_vnni", "AVX512_CORE": "avx512",
         "AVX512_CORE_VNNI": "avx512", "AVX512_CORE_BF16": "avx512_bf16",
         "AVX512_CORE_FP16": "avx512_bf16", "AVX10_1_512": "avx512_bf16"}
CAP_VARIABLES = ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA", "DNNL_MAX_CPU_ISA")


def cpu_flags() -> frozenset[str]:
    """The flags /proc/cpuinfo reports for this CPU (empty where it cannot be read)."""
    return frozenset(cpu_info().get("flags", "").split())


def caps() -> dict[str, str]:
    """The ISA caps in force that bound nmt's levels: variable -> the highest level it
    leaves (a cap that leaves every level is not listed)."""
    values = {name: os.environ.get(name, "").upper() for name in CAP_VARIABLES}
    return {name: _CAPS[value] for name, value in values.items() if value in _CAPS}


def allowed(level: str) -> str | None:
    """Why this CPU and the caps rule `level` out, or None where they allow it."""
    needs = LEVELS[level][1]
    if level in X86_ONLY and platform.machine().lower() not in ("x86_64", "amd64"):
        return f"{level} is for x86-64, this is {platform.machine()}"
    missing = [flag for flag in needs if flag not in cpu_flags()]
    if missing:
        return f"this CPU lacks {', '.join(missing)}"
    for name, top in caps().items():
        if not set(needs) <= set(LEVELS[top][1]):
            return f"capped at {top} by {name}={os.environ[name]}"
    return None


def cpu_class() -> str:
    """The last level of LEVELS this CPU runs within the caps: what nmt sees it as."""
    return [level for level in LEVELS if allowed(level) is None][-1]


@dataclass
class Status:
    """What `Kernel.library` found: the level loaded (None: nothing) and why."""

    level: str | None
    note: str


class Kernel:
    """One C kernel: `entry` its function taking one int64 parameter block of `params`
    entries (`entry`_params() says how many it reads), `agrees(lib)` its check against
    PyTorch."""

    def __init__(self, name: str, entry: str, params: int,
                 agrees: Callable[[ctypes.CDLL], bool]) -> None:
        self.name, self.entry, self.params, self.agrees = name, entry, params, agrees
        self._loaded: dict[tuple[str, ...], tuple[ctypes.CDLL | None, Status]] = {}

    def path(self, level: str) -> Path:
        """Where the library of `level` is installed (it may not exist)."""
        return HERE / f"{self.name}_{level}.so"

    def library(self) -> ctypes.CDLL | None:
        """The checked library of the best level here, or None (see `status`)."""
        return self._load()[0]

    def enabled(self) -> bool:
        """Whether the kernel is built for this CPU and checked here (and not turned off)."""
        return self.library() is not None

    def status(self) -> Status:
        """The level in use and why, or why none is."""
        return self._load()[1]

    def forget(self) -> None:
        """Choose and load again on next use (tests: another context)."""
        self._loaded.clear()

    def _load(self) -> tuple[ctypes.CDLL | None, Status]:
        if switch("NMT_KERNELS") == "0":
            return None, Status(None, "turned off by NMT_KERNELS=0")
        key = tuple(os.environ.get(name, "") for name in CAP_VARIABLES)
        if key not in self._loaded:
            self._loaded[key] = self._choose()
        return self._loaded[key]

    def _choose(self) -> tuple[ctypes.CDLL | None, Status]:
        """The best level built here that this CPU and the caps allow, loaded and checked."""
        reasons = []
        for level in reversed(KERNELS[self.name]):
            why = allowed(level) or (None if self.path(level).is_file()
                                     else "not built at install")
            if why is not None:
                reasons.append(f"{level}: {why}")
                continue
            return self._checked(level)
        return None, Status(None, "; ".join(reasons))

    def _checked(self, level: str) -> tuple[ctypes.CDLL | None, Status]:
        import torch  # lazily: choosing needs none of it

        try:
            lib = ctypes.CDLL(str(self.path(level)))
            entry, count = getattr(lib, self.entry), getattr(lib, f"{self.entry}_params")
        except (OSError, AttributeError) as err:
            return None, Status(None, f"{level}: cannot be loaded ({err})")
        entry.argtypes, entry.restype = [ctypes.c_void_p], ctypes.c_int
        count.restype = ctypes.c_int64
        if count() != self.params:
            return None, Status(None, f"{level}: a library of another version of nmt")
        try:  # whatever context the first use runs in (autocast in a bf16 validation)
            with torch.autocast("cpu", enabled=False), torch.inference_mode():
                ok = self.agrees(lib)
        except RuntimeError:
            ok = False
        if not ok:
            return None, Status(None, f"{level}: disagrees with PyTorch here")
        return lib, Status(level, f"{level}: loaded and checked")


@functools.cache
def float_bits(value: float) -> int:
    """The float32 bit pattern of `value`, as the kernels read a float from their int64
    parameter blocks."""
    return struct.unpack("<i", struct.pack("<f", value))[0]


def address(function: ctypes._CFuncPtr) -> int:
    """The address of a C function of a loaded library, for C code that calls it through
    a pointer (native_step.c calls the other kernels and MKL that way)."""
    return ctypes.cast(function, ctypes.c_void_p).value or 0


def call_linear(entry: ctypes._CFuncPtr, op: int, x: int = 0, m: int = 0, k: int = 0,
                ldx: int = 0, w: int = 0, n: int = 0, bias: int = 0, y: int = 0, ldy: int = 0,
                threads: int = 1, scale: int = 0) -> int:
    """Call a linear kernel's C entry (nmt_amx_linear, nmt_avx2_linear) with its 12-entry
    parameter block, in the order both C sources (and native_step.c) read it; its status."""
    params = array.array("q", (op, x, m, k, ldx, w, n, bias, y, ldy, threads, scale))
    return entry(params.buffer_info()[0])
