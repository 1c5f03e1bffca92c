"""Every NMT_* environment variable the library reads, listed here and read when used.

Settings a user chooses are flags and config fields (nmt/config.py). These switches are
for comparisons, debugging and tests: each turns one implementation choice off or forces
it, and none changes what a model computes beyond float rounding. Read at the moment of
use (never cached at import), so a test or a bench may set one and see it take effect.
`nmt prep`'s NMT_MIRROR is its `--mirror` flag's environment form (cli/prep.py).
"""

from __future__ import annotations

import os
from typing import NamedTuple


class Switch(NamedTuple):
    """One environment switch: its name, the value it has when unset, and what it does."""

    name: str
    default: str
    effect: str


SWITCHES: dict[str, Switch] = {s.name: s for s in (
    Switch("NMT_KERNELS", "1", "0 runs PyTorch's ops in place of every one of nmt's C kernels "
           "(nmt/kernels)"),
    Switch("NMT_DEFER_STATS", "", "1 or 0 forces the trainer's deferred (CUDA's) or in-line "
           "statistics path; unset: deferred on CUDA only (nmt/train/step.py)"),
    Switch("NMT_CHECK_LAYOUT", "0", "1 verifies every reorder layout the search promises the "
           "key/value cache, at two host reads a reorder (nmt/inference/kv_cache.py)"),
    Switch("NMT_PACKED_LINEAR", "1", "0 leaves CPU linears as torch's plain matmul instead "
           "of oneDNN with packed weights (nmt/inference/packed_linear.py)"),
    Switch("NMT_MKL_LINEAR", "1", "0 leaves fp32 CPU linears on an Intel CPU to oneDNN "
           "instead of MKL's packed sgemm (nmt/inference/mkl_linear.py)"),
    Switch("NMT_ROW_BUCKETS", "1", "0 leaves bf16 training's linear layers on a CPU with AMX at "
           "each batch's own row count instead of rounding it up (nmt/model/row_buckets.py)"),
    Switch("NMT_AMX_LINEAR", "1", "0 leaves bf16 CPU linears to oneDNN instead of the AMX "
           "C kernel built on first use where the CPU has AMX (nmt/inference/amx_linear.py)"),
    Switch("NMT_AMX_INT8", "1", "0 leaves int8 CPU linears to torch's FBGEMM / oneDNN "
           "kernels instead of the AMX C kernel where the CPU has AMX-INT8 "
           "(nmt/inference/amx_linear.py)"),
    Switch("NMT_AVX2_INT8", "1", "0 leaves int8 CPU linears without AMX-INT8 to torch's "
           "FBGEMM / oneDNN kernels instead of the AVX2 C kernel "
           "(nmt/inference/avx2_linear.py)"),
    Switch("NMT_FUSED_ATTENTION", "1", "0 leaves the CPU decoder step's attention to "
           "PyTorch's ops instead of the C kernel built on first use "
           "(nmt/model/fused_attention.py)"),
    Switch("NMT_FUSED_TOPK", "1", "0 leaves a CPU beam search step's log-softmax and top-k "
           "to PyTorch's ops instead of the C kernel built on first use "
           "(nmt/inference/step_topk.py)"),
    Switch("NMT_FUSED_ADD_NORM", "1", "0 leaves a post-norm residual at inference on a CPU "
           "(LayerNorm(x + sublayer)) to PyTorch's add and layer_norm instead of the C "
           "kernel built on first use (nmt/model/add_norm.py)"),
    Switch("NMT_NATIVE_STEP", "1", "0 leaves a CPU decoder step whose linears are MKL's "
           "(fp32) or the AMX kernels' (int8, bf16) to PyTorch's layers instead of the C "
           "step built on first use (nmt/inference/native_step.py)"),
    Switch("NMT_INT8_KERNEL", "", "fbgemm or onednn forces that int8 kernel; unset: each "
           "where it is faster (nmt/inference/int8_linear.py)"),
    Switch("NMT_INT8_OUTPUT", "1", "0 keeps an int8 model's vocabulary projection in fp32 "
           "(nmt/inference/int8_linear.py)"),
    Switch("NMT_HUGE_PAGE_HEAP", "1", "0 keeps `nmt train`'s heap in 4 KiB pages instead of "
           "re-executing it with glibc's heap in transparent huge pages "
           "(nmt/host_memory.py)"),
    Switch("NMT_SHORTLIST_REST", "1", "0 normalises a shortlist's log-probabilities over "
           "its candidates alone (as Marian and CTranslate2 do) instead of counting the "
           "estimated mass of the pieces it leaves out (nmt/inference/rest_mass.py)"),
)}


def switch(name: str) -> str:
    """The value of the switch `name` now (its default when unset); KeyError for a name
    not listed in SWITCHES."""
    return os.environ.get(name, SWITCHES[name].default)
