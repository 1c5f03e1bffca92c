"""`bench/gpu_train_speed.py --count-ops`: what one training update dispatches, counted on
a CPU along the GPU's code path, for each lever of issue 71, and what it moves.

The model runs on the CPU under `nmt.model.paths.cuda_paths()` (SDPA attention and torch's
dropout, as on CUDA) and a `TorchDispatchMode` counts every aten op the host dispatches in
one micro-batch's forward and backward (views and casts apart) and in the update's
optimizer step; it also sums the bytes each non-view, non-matmul op reads and writes (the
memory traffic of the kernels that are not matmuls) and the bytes autograd saves for the
backward (what a micro-batch holds: the planning of micro-batches). Both are counted at
two batch sizes and extrapolated to the update's, linearly in tokens (ops do not depend on
the batch size: the reference loss, one op per step whatever the rows).

Levers, each on top of the one before: `eager` (today: fp32 weights under bf16 autocast,
the update's micro-batches as the recipe's --max-tokens gives them); `bf16-weights` (a bf16
copy computes, nmt/train/half.py: no per-op casts); `padded-vocab` (its output matrix padded
to 64 rows); `one-micro` (the micro-batch planned from the device's memory: the update in
as few micro-batches as fit, nmt/train/micro_batch.py); `compile` (the model compiled per
length bucket, nmt/train/buckets.py; the host then calls the compiled graphs' kernels:
counted with the profiler on the CPU backend, generated kernels plus extern calls); and
`cuda-graphs` (each bucket's step one graph replay: the host calls one replay per forward
and backward, plus the ops outside the graph).
"""

from __future__ import annotations

import collections
import math
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch import Tensor
from torch.utils._python_dispatch import TorchDispatchMode

from nmt.config import TrainConfig, model_preset
from nmt.data.batching import Batch
from nmt.model.paths import cuda_paths
from nmt.model.transformer import Transformer
from nmt.precision import autocast
from nmt.train.buckets import bucket_length
from nmt.train.feed import Micro, to_device
from nmt.train.half import HalfWeights
from nmt.train.loss import target_positions
from nmt.train.micro_batch import USABLE, plan_cap, update_tokens
from nmt.train.schedule import build_optimizer
from nmt.train.step import LossOptions, apply_update, micro_loss

LEVERS = ("eager", "bf16-weights", "padded-vocab", "rows-linear", "one-micro", "compile",
          "cuda-graphs")
EAGER_PER_MICRO = ("eager", "bf16-weights", "padded-vocab", "rows-linear")
MATMULS = {"mm", "bmm", "addmm", "baddbmm", "linear", "matmul",
           "_scaled_dot_product_flash_attention_for_cpu",
           "_scaled_dot_product_flash_attention_for_cpu_backward"}
DEVICES_GIB = {"80 GB (H100)": 80e9, "141 GB (H200)": 141e9}
# The H200's measured peak memory of base at 8,805 tokens, reference loss, bf16 autocast
# (docs/performance.md, "On a GPU"): the calibration of the saved-bytes estimate.
H200_BASE_PEAK_GIB = 6.09
H200_BASE_TOKENS = 8805
# What the code the H200 ran (d590941: layers on (batch, len, d_model), a view on either
# side of each linear, fp32 weights under bf16 autocast, reference loss) dispatched, counted
# with this counter along the GPU's path on 2026-12-05, per 1-GPU and 8-GPU update: the
# records bench/gpu_model.py calibrates on ("as-measured"), since the eager records count
# today's network.
AS_MEASURED = {"1gpu": {"host_ops_per_micro": 2189, "views_per_micro": 1200,
                        "host_ops_per_update": 6576, "kernels_per_update": 2976,
                        "bytes_per_update": 111854998544.5},
               "8gpu": {"host_ops_per_micro": 2189, "views_per_micro": 1200,
                        "host_ops_per_update": 2198, "kernels_per_update": 998,
                        "bytes_per_update": 14952115597.1}}


class OpCounter(TorchDispatchMode):
    """Counts the aten ops dispatched within it, by kind, and the bytes non-matmul ops
    read and write; a cast of one of `weights` (parameter tensors) counts as a weight cast."""

    def __init__(self, weights: tuple[Tensor, ...] = ()) -> None:
        super().__init__()
        self.weights = {id(w) for w in weights}
        self.ops: collections.Counter[str] = collections.Counter()
        self.views = 0
        self.casts = 0
        self.weight_casts = 0
        self.bytes = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (),
                           kwargs: dict | None = None) -> Any:
        out = func(*args, **(kwargs or {}))
        name = func.overloadpacket.__name__
        self.ops[name] += 1
        if func.is_view:
            self.views += 1
            return out
        if name == "_to_copy":
            self.casts += 1
            if id(args[0]) in self.weights:
                self.weight_casts += 1
        if name not in MATMULS:
            self.bytes += sum(t.nbytes for t in _tensors(args, kwargs, out))
        return out

    @property
    def total(self) -> int:
        """Ops dispatched in all."""
        return sum(self.ops.values())


def _tensors(args: tuple, kwargs: dict | None, out: Any) -> list[Tensor]:
    """The tensors among an op's arguments and results. (No closure: a recursive one is a
    reference cycle that kept them alive until the next garbage collection, and autograd
    then copies a gradient it could have taken over.)"""
    leaves = pytree.tree_leaves((args, kwargs or {}, out))
    return [x for x in leaves if isinstance(x, Tensor)]


@dataclass
class Counted:
    """One micro-batch's counts at one size."""

    ops: int
    views: int
    casts: int
    weight_casts: int
    matmuls: int
    bytes: int
    saved_bytes: int
    by_op: dict[str, int] = field(default_factory=dict)


def synthetic_micro(rows: int, length: int, vocab: int, device: torch.device,
                    pad_to: int | None = None) -> Micro:
    """A micro-batch of `rows` pairs of `length` tokens (the last row one shorter, so the
    batch has padding as real ones do), optionally padded to a bucket width."""
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(4, vocab, (rows, length), generator=gen)
    ids[-1, -1] = 0  # PAD
    lens = torch.full((rows,), length)
    lens[-1] -= 1
    src = tgt_in = tgt_out = ids
    if pad_to is not None and pad_to > length:
        pad = torch.zeros(rows, pad_to - length, dtype=ids.dtype)
        src = tgt_in = tgt_out = torch.cat([ids, pad], 1)
    batch = Batch(src, tgt_in.clone(), tgt_out.clone(), int(lens.sum()), int(lens.sum()))
    select = target_positions(lens.numpy(), tgt_out.size(1))
    return to_device(batch, True, None if select is None else torch.from_numpy(select),
                     device)


def backward(loss_: Tensor, half: HalfWeights | None, ddp: bool) -> None:
    """A micro-batch's backward as `train_step` runs it: on the bf16 copy in one process,
    straight into the fp32 buffers (`HalfWeights.backward`); under DDP, or without a copy,
    into `.grad` (autograd's accumulation node per parameter)."""
    if half is not None and not ddp:
        half.backward(loss_)
    else:
        loss_.backward()


def count_micro(model: Transformer, compute: Transformer, half: HalfWeights | None,
                micro: Micro, loss: LossOptions, ddp: bool = False) -> Counted:
    """Counts of one micro-batch's forward and backward on `compute` (bf16 autocast unless
    it is `half`'s copy), the GPU's code path, in one process or under DDP (`ddp`: its
    all-reduce hooks apart), in the steady state (gradient buffers made)."""
    saved = [0]

    def pack(t: Tensor) -> Tensor:
        saved[0] += t.nbytes
        return t

    counter = OpCounter(tuple(model.parameters()))
    compute.train()

    def run() -> None:
        with autocast(torch.device("cpu"), "bf16") if half is None else nullcontext():
            smoothed, _ = micro_loss(compute, compute, micro, loss)
        backward(smoothed, half, ddp)
        if half is not None:
            half.gather()  # no ops: the update's end (count_step)
        for p in list(compute.parameters()) + list(model.parameters()):
            p.grad = None

    with cuda_paths():
        run()  # the buffers made, as after an update's first micro-batch
        with counter:
            run()
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            run()  # apart: the hooks dispatch ops of their own
    matmuls = sum(n for k, n in counter.ops.items() if k in MATMULS)
    return Counted(counter.total, counter.views, counter.casts, counter.weight_casts, matmuls,
                   counter.bytes, saved[0], dict(counter.ops.most_common(12)))


def count_step(model: Transformer, half: HalfWeights | None) -> int:
    """Ops of an update's end: gathering a bf16 copy's gradients, the gradient norm, fused
    Adam and zeroing, and refreshing the copy."""
    optimizer = build_optimizer(model.parameters(), TrainConfig(), torch.device("cpu"),
                                fused=True)
    scaler = torch.amp.GradScaler("cpu", enabled=False)
    source = model if half is None else half.model
    counter = OpCounter()
    for _ in range(2):  # the second: buffers and Adam's state exist (the steady state)
        for p in source.parameters():
            p.grad = torch.zeros_like(p)
        counter = OpCounter()
        with counter:
            if half is not None:
                half.gather()
            params = [p for p in model.parameters() if p.grad is not None]
            torch.nn.utils.get_total_norm([p.grad for p in params])
            apply_update(optimizer, scaler, finite=True)
            if half is not None:
                half.refresh()
    return counter.total


def compiled_calls(half: HalfWeights, micro: Micro, loss: LossOptions,
                   debug: bool = False) -> dict[str, Any]:
    """Compile `half`'s copy for the micro-batch's bucket on the CPU backend and count, with
    the profiler, what one compiled forward and backward calls: generated kernels and
    extern ops, in one process (`top_level_aten`) and with DDP's backward into `.grad`
    (`top_level_aten_ddp`); also Dynamo's graphs and graph breaks."""
    import torch._dynamo
    import torch._inductor.config as inductor
    from torch._dynamo.utils import counters
    from torch._inductor import metrics

    compute = half.model
    torch._dynamo.reset()
    counters.clear()
    metrics.reset()
    inductor.cpp.enable_kernel_profile = True  # each generated kernel a profiler event
    inductor.fx_graph_cache = False  # a cached graph would come without them
    net = torch.compile(compute, dynamic=False)

    def clear() -> None:  # as at an update's first micro-batch: gradients stolen, not added
        half.gather()
        for p in list(compute.parameters()) + list(half.master.parameters()):
            p.grad = None

    with cuda_paths():
        for _ in range(2):  # the first call compiles
            smoothed, _ = micro_loss(net, compute, micro, loss)
            backward(smoothed, half, ddp=False)
            clear()
        graphs = int(counters["stats"]["unique_graphs"])
        breaks = sum(counters["graph_break"].values())
        generated = int(metrics.generated_kernel_count)  # forward and backward graphs
        profiles = {}
        for ddp in (False, True):
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]
                                        ) as prof:
                smoothed, _ = micro_loss(net, compute, micro, loss)
                backward(smoothed, half, ddp)
            clear()
            profiles[ddp] = prof
    counts = {}
    for ddp, prof in profiles.items():
        kernels = extern = 0
        names: collections.Counter[str] = collections.Counter()
        for e in prof.events():
            parent = e.cpu_parent
            if e.name.startswith("cpp_fused") or e.name.startswith("cpp_"):
                kernels += 1  # a kernel inductor generated (profiled by its wrapper)
            elif e.name.startswith("aten::") and parent is not None and \
                    not parent.name.startswith("aten::"):
                extern += 1  # an op the compiled wrapper (or autograd) calls directly
                names[e.name] += 1
        if debug:
            print(f"ddp={ddp}", sorted({e.name for e in prof.events() if e.cpu_parent is None}))
            print(names.most_common(15))
        counts[ddp] = (kernels, extern)
    inductor.cpp.enable_kernel_profile = False
    return {"graphs": graphs, "graph_breaks": breaks,
            "kernels": max(counts[False][0], generated), "top_level_aten": counts[False][1],
            "top_level_aten_ddp": counts[True][1]}


def count_arch(arch: str, vocab: int, shapes: dict[str, tuple[int, int]],
               compile_levers: bool, say: Callable[[str], None]) -> list[dict[str, Any]]:
    """The records of `arch` for each shape {name: (micro-batches, micro tokens)}."""
    cfg = model_preset(arch, vocab_size=vocab)
    torch.manual_seed(0)
    model = Transformer(cfg)
    loss = LossOptions(0.1, cfg.pad_id)
    params = sum(p.numel() for p in model.parameters())
    half_plain = HalfWeights(model, pad_vocab=False)
    half_pad = HalfWeights(model, pad_vocab=True)
    # nmt train's copy on CUDA (nmt/train/setup.py): linear weights stored transposed
    half_rows = HalfWeights(model, pad_vocab=True, rows_linears=True)
    sizes = ((4, 24), (8, 48))  # (rows, length): tokens 96 and 384
    # per (lever, under DDP): 1 GPU runs one process, 8 GPUs DDP (backward into `.grad`)
    per: dict[tuple[str, bool], tuple[Counted, Counted]] = {}
    for lever, compute, half in (("eager", model, None), ("bf16-weights", half_plain.model,
                                                          half_plain),
                                 ("padded-vocab", half_pad.model, half_pad),
                                 ("rows-linear", half_rows.model, half_rows)):
        for ddp in (False, True):
            per[lever, ddp] = tuple(count_micro(model, compute, half, synthetic_micro(
                r, n, vocab, torch.device("cpu")), loss, ddp) for r, n in sizes)  # type: ignore
            c = per[lever, ddp][0]
            say(f"{arch} {lever}{' (DDP)' if ddp else ''}: {c.ops} ops per micro-batch "
                f"({c.views} views, {c.casts} casts, {c.weight_casts} weight casts, "
                f"{c.matmuls} matmuls)")
    step_ops = {"eager": count_step(model, None), "half": count_step(model, half_rows)}
    compiled = None
    if compile_levers:
        micro = synthetic_micro(8, 44, vocab, torch.device("cpu"), pad_to=bucket_length(44))
        say(f"{arch}: compiling for one bucket on the CPU backend...")
        compiled = compiled_calls(half_rows, micro, loss)
        say(f"{arch} compiled: {compiled}")
    small, large = (r * n for r, n in sizes)
    records = []
    for shape, (freq, micro_tokens) in shapes.items():
        fill = 0.945
        tokens = round(2 * freq * micro_tokens * fill)  # real source + target
        one_micro_freq = 1  # planned: see planning below
        ddp = shape != "1gpu"
        for lever in LEVERS:
            if lever in ("compile", "cuda-graphs") and compiled is None:
                continue
            base = per.get((lever, ddp), per["rows-linear", ddp])
            a, b = base

            def at(tokens_: float, x: float, y: float) -> float:
                return x + (y - x) * (tokens_ - small) / (large - small)

            f = freq if lever in EAGER_PER_MICRO else one_micro_freq
            m = micro_tokens * freq // f
            ops = b.ops
            kernels = b.ops - b.views
            cls = "eager"
            if compiled is not None:
                extern = compiled["top_level_aten_ddp" if ddp else "top_level_aten"]
                # what runs outside a graph: DDP's per-parameter accumulation
                outside = extern - compiled["top_level_aten"]
            if lever == "compile":
                ops = kernels = compiled["kernels"] + extern
                cls = "compiled"
            elif lever == "cuda-graphs":
                kernels = compiled["kernels"] + extern
                ops = 2 + outside  # one replay for the forward, one for the backward
                cls = "graphed"
            step = step_ops["eager" if lever == "eager" else "half"]
            bytes_ = f * at(m, a.bytes, b.bytes)
            records.append({
                "arch": arch, "lever": lever, "shape": shape, "micro_batches": f,
                "micro_tokens": m, "tokens_per_update": tokens, "params": params,
                "host_ops_per_update": f * ops + step, "host_ops_per_micro": ops,
                "kernels_per_update": f * kernels + step,
                "views_per_micro": b.views if cls == "eager" else 0,
                "weight_casts_per_micro": b.weight_casts if cls == "eager" else 0,
                "model_flops_per_update": 6.0 * params * tokens / 2,
                "attention_flops_per_update": attention_flops(cfg, tokens),
                "bytes_per_update": bytes_, "host_cost_class": cls,
                "saved_bytes_per_token": (b.saved_bytes - a.saved_bytes) / (large - small),
                "top_ops": b.by_op if cls == "eager" else None,
            })
    if arch == "base":  # the calibration's records: what the H200 ran
        for r in [r for r in records if r["lever"] == "eager"]:
            records.append({**r, **AS_MEASURED[r["shape"]], "lever": "as-measured",
                            "top_ops": None})
    if compiled is not None:
        for r in records:
            r["compiled_graphs"] = compiled["graphs"]
            r["graph_breaks"] = compiled["graph_breaks"]
    return records


def attention_flops(cfg: Any, tokens: int, mean_len: float = 28.0) -> float:
    """Forward + backward FLOPs of QK^T and AV at WMT-like lengths (`mean_len` per side):
    per token, about mean_len keys per layer and attention."""
    width = cfg.heads * (cfg.head_dim_k + cfg.head_dim_v)
    per_side = tokens / 2
    enc = cfg.encoder_layers * 2 * per_side * mean_len * width
    dec = cfg.decoder_layers * 2 * per_side * (mean_len / 2 + mean_len) * width
    return 3.0 * (enc + dec)


def micro_plans(records: list[dict[str, Any]], batch_tokens: int) -> list[dict[str, Any]]:
    """The planned micro-batch cap of each arch on 80 GB and 141 GB devices, 1 and 8 GPUs:
    saved bytes per token (bf16 weights) scaled by the H200's measured peak over the same
    estimate for base (`H200_BASE_PEAK_GIB`), beside fp32 master weights, gradients and
    Adam's state."""
    out = []
    by_arch = {r["arch"]: r for r in records if r["lever"] == "rows-linear"}
    eager_base = next((r for r in records if r["arch"] == "base" and r["lever"] == "eager"),
                      None)
    scale = 1.0
    if eager_base is not None:
        estimate = eager_base["saved_bytes_per_token"] * H200_BASE_TOKENS + \
            16 * eager_base["params"]
        scale = H200_BASE_PEAK_GIB * 2 ** 30 / estimate
    for arch, r in by_arch.items():
        per_token = r["saved_bytes_per_token"] * scale
        static = r["params"] * (4 + 4 + 8 + 2 + 2)  # master, grads, Adam, bf16 copy + grads
        for label, mem in DEVICES_GIB.items():
            for gpus in (1, 8):
                need = update_tokens(batch_tokens, gpus)
                cap = plan_cap(int(mem), static, per_token, need, 256)
                out.append({"arch": arch, "device": label, "gpus": gpus,
                            "bytes_per_token": per_token, "update_tokens_needed": need,
                            "micro_tokens": cap,
                            "micro_batches": math.ceil(need / cap),
                            "usable_fraction": USABLE})
    return out


def run(archs: list[str], vocab: int, batch_tokens: int, max_tokens: int,
        compile_levers: bool, say: Callable[[str], None]) -> dict[str, Any]:
    """Every arch's records at the recipe's 1-GPU and 8-GPU shapes (as `nmt train` derives
    them, `shapes_of`) and the micro-batch plans: the JSON the GPU model reads."""
    records: list[dict[str, Any]] = []
    for arch in archs:
        records += count_arch(arch, vocab, shapes_of(batch_tokens, max_tokens), compile_levers,
                              say)
    return {"records": records, "micro_batch_plans": micro_plans(records, batch_tokens),
            "counted_on": "CPU, the GPU's code path (nmt.model.paths.cuda_paths)",
            "loss": "reference (what the H200 figures measured)"}


def shapes_of(batch_tokens: int, max_tokens: int) -> dict[str, tuple[int, int]]:
    """(micro-batches, tokens per micro-batch) of one GPU at 1 and 8 GPUs, as the bench's
    `update_shape` derives them on WMT-like lengths."""
    from gpu_train_speed import MAX_LEN, shape_lengths

    from nmt.data.batch_tokens import derive_batching

    out = {}
    for name, gpus in (("1gpu", 1), ("8gpu", 8)):
        cfg = TrainConfig(max_tokens=max_tokens, batch_tokens=batch_tokens, update_freq=1,
                          max_len=MAX_LEN)
        shape = derive_batching(cfg, gpus, *shape_lengths())
        out[name] = (shape.update_freq, shape.micro_tokens)
    return out


def print_tables(result: dict[str, Any]) -> None:
    """The counts per arch, shape and lever, then the planned micro-batches."""
    print(f"{'arch':5} {'shape':5} {'lever':13} {'micro':>5} {'host ops/micro':>14} "
          f"{'views':>6} {'w-casts':>7} {'host ops/update':>15} {'kernels/update':>14}")
    for r in result["records"]:
        print(f"{r['arch']:5} {r['shape']:5} {r['lever']:13} {r['micro_batches']:>5} "
              f"{r['host_ops_per_micro']:>14,} {r['views_per_micro']:>6,} "
              f"{r['weight_casts_per_micro']:>7,} {r['host_ops_per_update']:>15,} "
              f"{r['kernels_per_update']:>14,}")
    graphs = {r["arch"]: (r.get("compiled_graphs"), r.get("graph_breaks"))
              for r in result["records"] if "compiled_graphs" in r}
    for arch, (g, b) in graphs.items():
        print(f"{arch}: compiled for one bucket: {g} graph(s), {b} graph break(s)")
    print("planned micro-batch (tokens per GPU; the update in one where it fits):")
    for p in result["micro_batch_plans"]:
        print(f"  {p['arch']:5} {p['device']:14} {p['gpus']} GPU(s): cap {p['micro_tokens']:,}"
              f" for {p['update_tokens_needed']:,} needed -> {p['micro_batches']} micro-batch"
              f"(es), {p['bytes_per_token'] / 2 ** 20:.2f} MiB per token")
