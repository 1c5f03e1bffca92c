"""`nmt doctor`: what this machine and this install give nmt, as facts to read or paste.

The CPU (model, vector flags, the class nmt sees it as, the ISA caps in force), which C
kernels load and why the others do not, what `--precision auto` picks and why (the rule, and a
measurement of bf16 against fp32 on this CPU that `nmt doctor` repeats each time it runs),
threads, host memory settings, torch, CUDA and the driver, GPUs, and the optional extras.
Benches record it beside every figure; bug reports ask for `nmt doctor --json`.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import os
import platform
import shutil
import subprocess
from pathlib import Path
from typing import Any

import nmt
from nmt import kernels
from nmt.cores import available_cores, cpu_info
from nmt.host_memory import (
    INFERENCE_ONEDNN_CACHE,
    TRAIN_ONEDNN_CACHE,
    heap_in_huge_pages,
    huge_page_heap_env,
    thp_mode,
)
from nmt.kernels.levels import KERNELS
from nmt.switches import SWITCHES, switch

# The /proc/cpuinfo flags that decide what runs (vector widths, bf16, int8 dot products).
VECTOR_FLAGS = ("sse4_2", "avx", "avx2", "fma", "f16c", "avx_vnni", "avx512f", "avx512bw",
                "avx512vl", "avx512_vnni", "avx512_bf16", "avx512_fp16", "amx_tile",
                "amx_bf16", "amx_int8", "asimd", "sve")
# Environment variables that change which kernels run or how many threads they take.
SETTINGS = ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA", "DNNL_MAX_CPU_ISA",
            "MKL_ENABLE_INSTRUCTIONS", "FBGEMM_ENABLE_INSTRUCTIONS", "CT2_FORCE_CPU_ISA",
            "OMP_NUM_THREADS", "MKL_NUM_THREADS", "ONEDNN_PRIMITIVE_CACHE_CAPACITY",
            "GLIBC_TUNABLES", "PYTORCH_CUDA_ALLOC_CONF", "CUDA_VISIBLE_DEVICES")
# extra (pip install 'nmt[extra]') -> the distributions it installs
EXTRAS = {"ct2": ("ctranslate2",), "serve": ("starlette", "uvicorn"),
          "hf": ("transformers", "safetensors"), "tensorboard": ("tensorboard",),
          "plot": ("matplotlib",)}


def report(measure: bool = True) -> dict[str, Any]:
    """Every fact `nmt doctor` prints, as plain data (its --json); `measure`: time bf16
    against fp32 here (about a second)."""
    import torch

    return {"nmt": {"version": nmt.__version__, "path": str(Path(nmt.__file__).parent)},
            "python": platform.python_version(), "platform": platform.platform(),
            "torch": _torch(torch), "cpu": _cpu(), "kernels": _kernels(),
            "backends": _backends(), "precision": _precision(measure), "threads": _threads(torch),
            "memory": _memory(), "gpus": _gpus(torch), "extras": _extras(),
            "settings": {name: os.environ[name] for name in (*SETTINGS, *SWITCHES)
                         if name in os.environ}}


def _torch(torch: Any) -> dict[str, Any]:
    return {"version": torch.__version__, "cuda": torch.version.cuda,
            "mkl": torch.backends.mkl.is_available(),
            "onednn": torch.backends.mkldnn.is_available(),
            "capability": torch.backends.cpu.get_cpu_capability()}


def _cpu() -> dict[str, Any]:
    info = cpu_info()
    flags = kernels.cpu_flags()
    return {"model": info.get("model name") or platform.processor() or platform.machine(),
            "vendor": info.get("vendor_id", ""), "machine": platform.machine(),
            "cores": available_cores(), "flags": [f for f in VECTOR_FLAGS if f in flags],
            "class": kernels.cpu_class(), "caps": kernels.caps()}


def _kernels() -> dict[str, dict[str, Any]]:
    found = {}
    for module in ("fused_attention", "add_norm", "step_topk", "native_step", "avx2_linear",
                   "amx_linear"):  # the modules of nmt/inference that hold a KERNEL
        kernel = importlib.import_module(f"nmt.inference.{module}").KERNEL
        status = kernel.status()
        found[kernel.name] = {"level": status.level, "note": status.note,
                              "built": [level for level in KERNELS[kernel.name]
                                        if kernel.path(level).is_file()]}
    return found


def _backends() -> dict[str, Any]:
    """This CPU's column of nmt/inference/backends.py's table and what runs for each row."""
    from nmt.inference import backends

    levels = {name: kernel["level"] for name, kernel in _kernels().items()}
    return {"column": backends.column(), "runs": backends.here(levels)}


def _precision(measure: bool) -> dict[str, Any]:
    from nmt.precision import BF16_PAYS_FROM, bf16_rule, cpu_native, measure_bf16_speedup

    pays, why = bf16_rule()
    facts: dict[str, Any] = {"cpu_auto": "bf16" if pays else "fp32", "why": why}
    if measure and cpu_native("bf16"):
        timing = measure_bf16_speedup(repeats=15)
        facts["measured"] = timing
        facts["agrees"] = (timing["speedup"] >= BF16_PAYS_FROM) == pays
    return facts


def _threads(torch: Any) -> dict[str, Any]:
    from nmt.inference.workers import plan_workers

    cores = available_cores()
    plan = plan_workers(None, None, "cpu", cores)
    return {"torch_intra_op": torch.get_num_threads(),
            "torch_inter_op": torch.get_num_interop_threads(),
            "translate_workers": plan.workers, "translate_threads_per_worker": plan.threads,
            "train_threads": cores}


def _memory() -> dict[str, Any]:
    libc = platform.libc_ver()
    return {"libc": " ".join(libc).strip(), "transparent_huge_pages": thp_mode(),
            "train_reexecs_with_huge_page_heap": (huge_page_heap_env(os.environ) is not None
                                                  and switch("NMT_HUGE_PAGE_HEAP") != "0"),
            "heap_in_huge_pages_now": heap_in_huge_pages(),
            "onednn_primitive_cache": {"translate": INFERENCE_ONEDNN_CACHE,
                                       "train": TRAIN_ONEDNN_CACHE},
            "keeps_freed_memory": libc[0] == "glibc"}


def _gpus(torch: Any) -> dict[str, Any]:
    found: dict[str, Any] = {"available": torch.cuda.is_available(), "devices": [],
                             "driver": _driver()}
    if found["available"]:
        for i in range(torch.cuda.device_count()):
            props = torch.cuda.get_device_properties(i)
            found["devices"].append({"name": props.name,
                                     "memory_gib": round(props.total_memory / 2 ** 30, 1),
                                     "capability": f"{props.major}.{props.minor}",
                                     "bf16": torch.cuda.is_bf16_supported()})
    return found


def _driver() -> str | None:
    """The NVIDIA driver's version (nvidia-smi), None without one."""
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return None
    try:
        proc = subprocess.run([smi, "--query-gpu=driver_version", "--format=csv,noheader"],
                              capture_output=True, text=True, timeout=20, check=False)
    except (OSError, subprocess.SubprocessError):
        return None
    lines = proc.stdout.split()
    return lines[0] if proc.returncode == 0 and lines else None


def _extras() -> dict[str, dict[str, str | None]]:
    """Per extra, the version of each distribution it installs (None: not installed)."""
    return {extra: {name: _version(name) for name in names} for extra, names in EXTRAS.items()}


def _version(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def text(facts: dict[str, Any]) -> str:
    """The report as indented `key: value` lines for a person to read."""
    lines: list[str] = []

    def put(key: str, value: Any, indent: str) -> None:
        if isinstance(value, dict) and value:
            lines.append(f"{indent}{key}:")
            for name, inner in value.items():
                put(name, inner, indent + "  ")
        elif isinstance(value, list) and value and isinstance(value[0], dict):
            for i, inner in enumerate(value):
                put(f"{key} {i}", inner, indent)
        else:
            lines.append(f"{indent}{key}: {_plain(value)}")

    for key, value in facts.items():
        put(key, value, "")
    return "\n".join(lines)


def _plain(value: object) -> str:
    """A fact as text: yes/no, none, numbers to 3 digits, lists space-separated."""
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, float):
        return f"{value:.3g}"
    if isinstance(value, list | tuple):
        return " ".join(map(str, value)) or "none"
    return "none" if value in (None, {}, "") else str(value)
