"""`nmt doctor`: what this machine and this install give nmt, as facts to read or paste.

The CPU (model, vector flags, the class nmt sees it as, the ISA caps in force), which C
kernels load and why the others do not, what `--precision auto` picks and why (the rule, and a
measurement of bf16 against fp32 on this CPU that `nmt doctor` repeats each time it runs),
threads, host memory settings, torch, CUDA and the driver, GPUs, and the optional extras.
Benches record it beside every figure; bug reports ask for `nmt doctor --json`.
"""

from __future__ import annotations

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
    from nmt.inference import (
        add_norm,
        amx_linear,
        avx2_linear,
        fused_attention,
        native_step,
        step_topk,
    )

    found = {}
    for module in (fused_attention, add_norm, step_topk, native_step, avx2_linear,
                   amx_linear):
        kernel = module.KERNEL
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
    found = {}
    for extra, names in EXTRAS.items():
        versions = {}
        for name in names:
            try:
                versions[name] = importlib.metadata.version(name)
            except importlib.metadata.PackageNotFoundError:
                versions[name] = None
        found[extra] = versions
    return found


def text(facts: dict[str, Any]) -> str:
    """The report as lines for a person to read."""
    cpu, torch_, prec = facts["cpu"], facts["torch"], facts["precision"]
    caps = ", ".join(f"{k}={v}" for k, v in cpu["caps"].items()) or "none"
    lines = [f"nmt {facts['nmt']['version']} ({facts['nmt']['path']}), Python "
             f"{facts['python']}, {facts['platform']}",
             f"torch {torch_['version']} (CUDA {torch_['cuda'] or 'none'}; MKL "
             f"{_yes(torch_['mkl'])}, oneDNN {_yes(torch_['onednn'])}; ATen kernels "
             f"{torch_['capability']})",
             f"CPU: {cpu['model']} ({cpu['vendor'] or cpu['machine']}), {cpu['cores']} cores "
             "for this process",
             f"  vector flags: {' '.join(cpu['flags']) or 'none found'}",
             f"  class: {cpu['class']} (caps below the CPU: {caps})",
             "C kernels (built at install, one library per ISA level):"]
    width = max(map(len, facts["kernels"]))
    for name, kernel in facts["kernels"].items():
        lines.append(f"  {name:<{width}}  {kernel['level'] or '-':<11}  {kernel['note']}")
    lines.append(f"backends (column {facts['backends']['column']} of "
                 "nmt/inference/backends.py's table):")
    width = max(map(len, facts["backends"]["runs"]))
    for row, backend in facts["backends"]["runs"].items():
        lines.append(f"  {row:<{width}}  {backend}")
    line = f"precision auto on this CPU: {prec['cpu_auto']} ({prec['why']})"
    if "measured" in prec:
        m = prec["measured"]
        line += (f"; measured now: bf16 matmul {m['speedup']:.2f}x fp32's speed "
                 f"({m['fp32_ms']:.2f} vs {m['bf16_ms']:.2f} ms, 512x512x512, 1 thread)")
        if not prec["agrees"]:
            line += ("; the measurement disagrees with the rule here: pass --precision "
                     "bf16 or fp32 to choose")
    lines.append(line)
    th = facts["threads"]
    lines.append(f"threads: torch {th['torch_intra_op']} intra-op, {th['torch_inter_op']} "
                 f"inter-op; nmt translate: {th['translate_workers']} worker(s) x "
                 f"{th['translate_threads_per_worker']} thread(s); nmt train: "
                 f"{th['train_threads']} threads a process")
    mem = facts["memory"]
    lines.append(f"memory: {mem['libc'] or 'libc unknown'}, transparent huge pages "
                 f"{mem['transparent_huge_pages'] or 'absent'}; nmt train re-executes with "
                 f"its heap in huge pages: {_yes(mem['train_reexecs_with_huge_page_heap'])}"
                 "; train and translate keep freed memory for reuse: "
                 f"{_yes(mem['keeps_freed_memory'])}")
    gpus = facts["gpus"]
    if gpus["devices"]:
        for i, gpu in enumerate(gpus["devices"]):
            lines.append(f"GPU {i}: {gpu['name']}, {gpu['memory_gib']} GiB, compute "
                         f"capability {gpu['capability']}, driver {gpus['driver'] or '?'}")
    else:
        lines.append("GPUs: none visible to torch"
                     + (f" (driver {gpus['driver']})" if gpus["driver"] else ""))
    extras = []
    for extra, versions in facts["extras"].items():
        have = all(versions.values())
        extras.append(f"{extra} " + (", ".join(f"{k} {v}" for k, v in versions.items())
                                     if have else "no"))
    lines.append("extras: " + "; ".join(extras))
    if facts["settings"]:
        lines.append("settings: " + " ".join(f"{k}={v}" for k, v in
                                             facts["settings"].items()))
    return "\n".join(lines)


def _yes(value: object) -> str:
    return "yes" if value else "no"
