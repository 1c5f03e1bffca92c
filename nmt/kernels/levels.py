"""The ISA levels nmt's C kernels are built for, and which kernel is built at which.

Plain data, read by the build (setup.py, by path: nothing of the package is imported at
install) and by the loader (nmt/kernels/__init__.py). A level is the compiler flags its
libraries are built with and the /proc/cpuinfo flags a CPU must report to run them; the
loader takes, for each kernel, the last level of its list that the CPU reports and the ISA
caps allow. `baseline` has no flags: the architecture's own (SSE2 on x86-64, NEON on
AArch64), for other architectures and for the caps' `default`.
"""

from __future__ import annotations

_AVX2 = ("-mavx2", "-mfma", "-mf16c"), ("avx2", "fma", "f16c")
_AVX512 = (_AVX2[0] + ("-mavx512f", "-mavx512cd", "-mavx512bw", "-mavx512dq", "-mavx512vl"),
           _AVX2[1] + ("avx512f", "avx512cd", "avx512bw", "avx512dq", "avx512vl"))
_AVX512_BF16 = (_AVX512[0] + ("-mavx512bf16", "-mavx512vnni"),
                _AVX512[1] + ("avx512_bf16", "avx512_vnni"))

# name: (compiler flags, CPU flags required), in order: a CPU's class is the last it runs.
LEVELS: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    "baseline": ((), ()),
    "avx2": _AVX2,
    "avx2_vnni": (_AVX2[0] + ("-mavxvnni",), _AVX2[1] + ("avx_vnni",)),
    "avx512": _AVX512,
    "avx512_bf16": _AVX512_BF16,
    "amx": (_AVX512_BF16[0] + ("-mamx-tile", "-mamx-bf16", "-mamx-int8"),
            _AVX512_BF16[1] + ("amx_tile", "amx_bf16", "amx_int8")),
}

# kernel (its source nmt/kernels/<name>.c): the levels it is built at, each one whose code
# differs from the one before it (vector width, native bf16 rounding, VNNI, AMX tiles).
KERNELS: dict[str, tuple[str, ...]] = {
    "fused_attention": ("baseline", "avx2", "avx512"),
    "add_norm": ("baseline", "avx2", "avx512", "avx512_bf16"),
    "step_topk": ("baseline", "avx2", "avx512"),
    "native_step": ("baseline", "avx2", "avx512"),
    "avx2_linear": ("avx2", "avx2_vnni"),
    "amx_linear": ("amx",),
}

X86_ONLY = frozenset(LEVELS) - {"baseline"}  # the levels other architectures skip
