"""Training throughput and MFU of `base` / `big` on one GPU, synthetic WMT-length batches.

What one timed update runs: `train_step` and `apply_update` (nmt/train/step.py), the
functions `nmt train` runs, with batches collated ahead as a prefetching loop would have
them: for each of the update's micro-batches, the host-to-device copy, the real
`Transformer` (`--arch` preset, vocabulary 37,000, shared embeddings, dropout as the
preset) under autocast (`--precision`, bf16 by default), only the
non-PAD target rows projected, the label-smoothed loss (eps 0.1) and backward, the
gradient norm; then Adam from `nmt.train.schedule.build_optimizer` (fused on CUDA) with the
paper's schedule (the Trainer's finiteness check is left out: it is the update's host sync).
`--loss reference` is `nmt train --fused-loss off` (`model(..., select=rows)` logits +
`label_smoothed_nll`); `--loss fused` is `--fused-loss on` (the decoder features projected
by the chunked `projected_smoothed_loss`: no (rows, V) tensor), `--loss fused-compiled` the
same with its per-chunk softmax and gradient kernels torch.compile'd. `--compile` wraps the
model in `torch.compile`. Warm-up (untimed): the `--warmup` updates, then the timed updates
once, so each batch shape's first-time costs (compilation, kernel selection) are not timed.

`--loss both` (or a comma-separated list, `all` for the three) times the losses one after
the other in this process, on the same batches from the same initial weights and dropout
seed, each with its own model and optimizer (the previous one freed, its peak-memory
counters reset): the measurement behind `--fused-loss auto` (fused on CUDA). The JSON line
then carries the first loss's figures under the usual keys, each loss's under `by_loss`,
and `fastest_loss`, `step_time_vs_first`, `lowest_memory_loss`, the first updates' loss
difference (the losses compute the same function: it should be rounding only) and whether
auto's choice on this device is the faster one. Run order favours neither: each loss warms
up on every batch it then times (without that, the first loss ran 2.5x slower in the CPU
smoke, whichever it was).

Batches: source lengths drawn log-normally like WMT14 En-De BPE pieces (mean about 27,
long tail cut at 255 so pairs fit `max_len` 256 with EOS), target length = source x a
log-normal ratio around 1.05; grouped by the project's own `batch_by_tokens` and shuffled.
The shape is that of one GPU of a `--gpus N` run of the WMT recipe, as `nmt train` derives
it (`derive_batching`: --batch-tokens real tokens per side per update, from the fill of
micro-batches measured on `SHAPE_PAIRS` pairs of these WMT-like lengths, seeded): N = 1
(default) is 3 x 8,805, N = 8 is 1 x 3,308 per GPU (micro-batches about 94.5 % full).
`--update-freq F` instead runs F x `--max-tokens` as given. With
N > 1 the figures are one GPU's share: the gradients' all-reduce is not timed, so
`tokens_per_s_all_gpus_no_comm` (N x tokens/s) is an upper bound for the whole job. Token
ids are random (speed does not depend on them).

Figures: tokens/s counts non-PAD source + target tokens (EOS included), as `nmt train`
logs; step time is per update (host sync only at the ends of the timed window).
Model FLOPs count each parameter for the tokens it multiplies, 6 per parameter per token
(forward 2, backward 4): encoder weights x source tokens, decoder weights and the output
projection (V x d) x target tokens; embedding lookups cost none. With source and target
equally long this equals 6 x params x (source + target tokens) / 2; the literal
6 x params x (source + target) (`mfu_6n_all_tokens`) counts every weight for every token
and overstates an encoder-decoder's FLOPs about twice. Attention score/value FLOPs
(QK^T and AV over the real lengths, decoder self-attention causal: half the square) are
reported apart (`attention_tflops`, `mfu_with_attention`). MFU = model FLOP/s over the
device's dense bf16 peak (`PEAKS`, or --peak-tflops). Padding computed by the encoder
and decoder is not useful work, so it lowers MFU. Peak memory: CUDA's allocator peaks over
the timed updates; on a CPU the process's peak RSS since the timed updates began (VmHWM,
reset through /proc/self/clear_refs; indicative only: freed memory may stay mapped).

    .venv/bin/python bench/gpu_train_speed.py --arch base [--compile] [--loss fused]
    .venv/bin/python bench/gpu_train_speed.py --arch base --gpus 8 --loss both
    .venv/bin/python bench/gpu_train_speed.py --smoke [--gpus 8 --loss both]  # CPU, tiny
Prints a table (one per loss) and one JSON line. `--smoke`: CPU, tiny model, vocabulary
1,000, max-tokens 1,024 and batch-tokens 2,048 (the recipe's ratio: 1 GPU 3 x 739, 8 GPUs
1 x 292), 1 + 2 warm-up then 2 timed updates per loss; CPU figures, never GPU ones.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import sys
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor, nn

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))

from results import record  # noqa: E402  (bench/results/record.py)

from nmt.config import TrainConfig, model_preset  # noqa: E402
from nmt.data.batch_tokens import derive_batching  # noqa: E402
from nmt.data.batching import Batch, batch_by_tokens, collate  # noqa: E402
from nmt.data.recipes import load_recipe  # noqa: E402
from nmt.device import allow_tf32, resolve_device  # noqa: E402
from nmt.model.transformer import Transformer  # noqa: E402
from nmt.precision import grad_scaler  # noqa: E402
from nmt.train import micro_batch  # noqa: E402
from nmt.train.buckets import bucket_length  # noqa: E402
from nmt.train.feed import Shapes, to_device  # noqa: E402
from nmt.train.half import HalfWeights  # noqa: E402
from nmt.train.loss import (  # noqa: E402
    DEFAULT_CHUNK_ROWS,
    fused_loss_enabled,
    target_positions,
)
from nmt.train.schedule import Schedule, build_optimizer, build_schedule  # noqa: E402
from nmt.train.step import (  # noqa: E402
    LossOptions,
    advance,
    apply_update,
    compiled,
    train_step,
)

# Dense (no sparsity) bf16 tensor-core peaks in TFLOP/s, from NVIDIA's datasheets: H100
# SXM 1,979 and H100 PCIe 1,513 "with sparsity" (H100 Tensor Core GPU datasheet), H200
# 1,979 with sparsity (H200 datasheet), halved for dense; A100 312 dense (A100 datasheet).
# Matched in order against torch.cuda.get_device_name() ("NVIDIA H100 80GB HBM3" is SXM).
PEAKS: tuple[tuple[str, float, str], ...] = (
    ("H100 PCIe", 756.0, "H100 PCIe"),
    ("H100 NVL", float("nan"), "H100 NVL (not in the table: pass --peak-tflops)"),
    ("H100", 989.0, "H100 SXM"),
    ("H200", 989.0, "H200"),
    ("A100", 312.0, "A100"),
)
VOCAB = 37000
LABEL_SMOOTHING = 0.1
MEAN_PIECES = 27.0  # WMT14 En-De source sentence, BPE pieces
LENGTH_SIGMA = 0.6  # log-normal spread: a long tail (about 1 in 40,000 beyond 255)
SHAPE_PAIRS = 200_000  # WMT-like pairs the update's shape is derived from (fill within 0.1 %)
MAX_LEN = 256  # pieces + EOS, TrainConfig's max_len
LOSSES = ("reference", "fused", "fused-compiled")
LOSS_ALIASES: dict[str, tuple[str, ...]] = {"both": ("reference", "fused"), "all": LOSSES}


@dataclass
class HostBatch:
    """One collated micro-batch on the host plus what the loop knows from lengths."""

    batch: Batch
    select: np.ndarray | None  # flat indices of non-PAD target positions
    has_pad: bool
    src_lens: np.ndarray  # non-PAD tokens per row, EOS included
    tgt_lens: np.ndarray


def wmt_lengths(n: int, rng: np.random.Generator, mean: float = MEAN_PIECES,
                sigma: float = LENGTH_SIGMA) -> tuple[np.ndarray, np.ndarray]:
    """(source, target) lengths in pieces (no EOS) of `n` WMT14 En-De-like pairs."""
    mu = math.log(mean) - sigma ** 2 / 2  # log-normal with this mean
    src = np.clip(np.rint(rng.lognormal(mu, sigma, n)), 1, MAX_LEN - 1).astype(np.int64)
    ratio = rng.lognormal(math.log(1.05), 0.12, n)
    tgt = np.clip(np.rint(src * ratio), 1, MAX_LEN - 1).astype(np.int64)
    return src, tgt


def shape_lengths() -> tuple[np.ndarray, np.ndarray]:
    """(source, target) lengths of the WMT-like corpus `update_shape` derives the shape
    from: `SHAPE_PAIRS` pairs, always the same (seed 0), so bench/gpu_check.py re-derives
    the shape this bench ran."""
    return wmt_lengths(SHAPE_PAIRS, np.random.default_rng(0))


def make_batches(count: int, max_tokens: int, vocab: int, seed: int,
                 mean: float = MEAN_PIECES) -> list[HostBatch]:
    """`count` shuffled micro-batches of random ids, batched by `batch_by_tokens`."""
    rng = np.random.default_rng(seed)
    pool = max(20_000, 4 * count * max_tokens // int(mean))
    src_lens, tgt_lens = wmt_lengths(pool, rng, mean)
    groups = batch_by_tokens(src_lens, tgt_lens, max_tokens, MAX_LEN).batches
    picks = rng.choice(len(groups), size=count, replace=count > len(groups))
    out = []
    for g in picks:
        idx = groups[g]
        batch = collate([rng.integers(4, vocab, s) for s in src_lens[idx]],
                        [rng.integers(4, vocab, t) for t in tgt_lens[idx]])
        s_cost, t_cost = src_lens[idx] + 1, tgt_lens[idx] + 1
        out.append(HostBatch(batch, target_positions(t_cost, batch.tgt_out.size(1)),
                             bool(s_cost.min() != s_cost.max()), s_cost, t_cost))
    return out


def split_params(model: Transformer) -> dict[str, int]:
    """Parameters by the tokens they multiply: encoder, decoder, output projection."""
    def count(*modules: nn.Module | None) -> int:
        return sum(p.numel() for m in modules if m is not None for p in m.parameters())

    return {"encoder": count(model.encoder, model.enc_norm, model.enc_positions),
            "decoder": count(model.decoder, model.dec_norm, model.dec_positions),
            "output_projection": model.output_weight.numel(),
            "total": model.num_parameters()}


def attention_flops(model: Transformer, batches: list[HostBatch]) -> float:
    """Forward + backward FLOPs of QK^T and AV over the real lengths of `batches`."""
    cfg = model.config
    width = cfg.heads * (cfg.head_dim_k + cfg.head_dim_v)  # per query-key pair, x2 FLOPs
    total = 0.0
    for hb in batches:
        s = hb.src_lens.astype(np.float64)
        t = hb.tgt_lens.astype(np.float64)
        enc = cfg.encoder_layers * 2 * (s * s).sum() * width
        dec = cfg.decoder_layers * 2 * ((t * (t + 1) / 2).sum() + (t * s).sum()) * width
        total += 3 * (enc + dec)  # forward 1x, backward 2x
    return total


def device_peak(device: torch.device, override: float | None) -> tuple[float | None, str]:
    """(dense bf16 peak TFLOP/s, label) for `device`: --peak-tflops, else `PEAKS`."""
    if override:
        return override, f"{override:g} TFLOP/s (--peak-tflops)"
    if device.type != "cuda":
        return None, "no peak for a CPU (pass --peak-tflops for an MFU)"
    name = torch.cuda.get_device_name(device)
    for key, peak, label in PEAKS:
        if key in name:
            return (None if math.isnan(peak) else peak), label
    return None, f"{name}: not in the peak table (pass --peak-tflops)"


def peak_host_rss() -> int:
    """Peak resident set of this process (VmHWM), bytes."""
    with open("/proc/self/status", encoding="ascii") as handle:
        for line in handle:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    return 0


def reset_host_peak() -> None:
    """Restart this process's VmHWM from its current RSS (Linux clear_refs 5; no-op where
    that is refused), so a CPU peak covers only what follows."""
    try:
        with open("/proc/self/clear_refs", "w", encoding="ascii") as handle:
            handle.write("5")
    except OSError:
        pass


def update_shape(opt: argparse.Namespace) -> tuple[int, int, float | None]:
    """(micro-batches per update, padded tokens per micro-batch, measured fill) on one GPU
    of an `opt.gpus`-GPU run: `derive_batching` from --batch-tokens and --max-tokens as
    `nmt train` does (max_len 256) on WMT-like lengths (`shape_lengths`), or --update-freq
    x --max-tokens when given (fill None: not measured)."""
    if opt.update_freq:
        return opt.update_freq, opt.max_tokens, None
    cfg = TrainConfig(max_tokens=opt.max_tokens, batch_tokens=opt.batch_tokens,
                      update_freq=1, max_len=MAX_LEN)
    shape = derive_batching(cfg, opt.gpus, *shape_lengths())
    return shape.update_freq, shape.micro_tokens, shape.fill


def train_update(micro: list[HostBatch], net: nn.Module, model: Transformer,
                 opt: argparse.Namespace, loss_name: str, device: torch.device,
                 precision: str, optimizer: torch.optim.Optimizer,
                 scaler: torch.amp.GradScaler, schedule: Schedule,
                 half: HalfWeights | None = None, shapes: Shapes | None = None) -> Tensor:
    """One update over `micro` through `train_step` and `apply_update` (what `nmt train`
    runs) with the loss `loss_name`; returns the mean token loss as a device scalar (no
    host sync: the update is applied as finite, the Trainer's check needs the sync this
    bench leaves out)."""
    tokens = sum(int(hb.tgt_lens.sum()) for hb in micro)
    loss = LossOptions(LABEL_SMOOTHING, model.config.pad_id, fused=loss_name != "reference",
                       chunk_rows=opt.chunk_rows, compiled=loss_name == "fused-compiled")
    if shapes is not None:  # --compile: padded to the length bucket, as the feed does
        on_device = [shapes.prepare(hb.batch, hb.src_lens, hb.tgt_lens, device)
                     for hb in micro]
    else:
        on_device = [to_device(hb.batch, hb.has_pad, None if hb.select is None
                               else torch.from_numpy(hb.select), device)
                     for hb in micro]  # as the Trainer's feed hands them over
    compute = model if half is None else half.model
    step = train_step(net, compute, on_device, tgt_tokens=tokens, optimizer=optimizer,
                      scaler=scaler, precision=precision, loss=loss, half=half)
    apply_update(optimizer, scaler, finite=True)
    if half is not None:
        half.refresh()
    advance(schedule, None, finite=True)
    return step.loss_sum / tokens


def profile_updates(updates: list[list[HostBatch]], update: Any,
                    device: torch.device, top: int = 15) -> dict:
    """Run `updates` once more under torch.profiler: wall time, the device's kernel time
    (busy fraction: below 1 the GPU waits on the host), the host time in ops, and the top
    kernels by device time. Where the step time goes, when MFU is low."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(ProfilerActivity.CUDA)
    sync(device)
    with profile(activities=activities) as prof:
        start = time.perf_counter()
        for micro in updates:
            update(micro)
        sync(device)
        wall = time.perf_counter() - start
    averages = prof.key_averages()
    # Kernel rows are the device's events; a CPU op's own device time repeats the kernels
    # it launched, so only device rows are summed (as torch's own table footer does).
    kernels = [e for e in averages if e.device_type != DeviceType.CPU]
    kernel_us = sum(float(e.self_device_time_total) for e in kernels)
    host_ops = [e for e in averages if e.device_type == DeviceType.CPU]

    def row(e: Any) -> dict:
        on_device = e.device_type != DeviceType.CPU
        return {"name": e.key[:90], "calls": int(e.count),
                "device_ms": float(e.self_device_time_total) / 1e3 if on_device else 0.0,
                "host_ms": float(e.self_cpu_time_total) / 1e3}

    top_kernels = sorted(kernels, key=lambda e: float(e.self_device_time_total),
                         reverse=True)[:top]
    top_host = sorted(host_ops, key=lambda e: float(e.self_cpu_time_total), reverse=True)[:top]
    launches = sum(int(e.count) for e in host_ops
                   if "cudaLaunchKernel" in e.key or "cuLaunchKernel" in e.key)
    return {"updates": len(updates), "wall_ms": wall * 1e3,
            "device_kernel_ms": kernel_us / 1e3 if kernels else None,
            "device_busy": kernel_us / 1e6 / wall if kernels else None,
            "kernel_launches_per_update": launches / len(updates) if launches else None,
            "host_op_ms": sum(float(e.self_cpu_time_total) for e in host_ops) / 1e3,
            "top": [row(e) for e in top_kernels], "top_host": [row(e) for e in top_host]}


def print_profile(p: dict, step_time_s: float) -> None:
    """The profile's summary and its top rows; the device's kernel time per update set
    against the unprofiled step time (the profiler's own overhead stretches its wall)."""
    busy = "n/a" if p["device_busy"] is None else f"{100 * p['device_busy']:.0f}%"
    if p["device_kernel_ms"] is not None:
        per_update = p["device_kernel_ms"] / p["updates"]
        print(f"kernels       {per_update:.1f} ms per update on the device, against "
              f"{1e3 * step_time_s:.1f} ms unprofiled: the GPU works "
              f"{100 * per_update / (1e3 * step_time_s):.0f}% of an update")
    launches = p["kernel_launches_per_update"]
    print(f"profile       {p['updates']} updates, {p['wall_ms']:.1f} ms wall, device busy "
          f"{busy}" + ("" if launches is None else f", {launches:.0f} kernel launches per "
                       "update"))
    print(f"  host time in ops {p['host_op_ms']:.1f} ms; top kernels by device time:")
    for row in p["top"]:
        print(f"  {row['device_ms']:9.2f} ms dev {row['calls']:6d}x  {row['name']}")
    print("  top host ops by their own host time:")
    for row in p["top_host"]:
        print(f"  {row['host_ms']:9.2f} ms host {row['calls']:6d}x  {row['name']}")


def sync(device: torch.device) -> None:
    """Wait for the device's queued work (CUDA; nothing to wait for on a CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def release(device: torch.device, compiled: bool) -> None:
    """Free what a finished loss run left (its model, optimizer, compiled graphs, cached
    CUDA blocks) so the next loss's peak memory is its own."""
    if compiled:
        torch._dynamo.reset()
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)


def time_loss(opt: argparse.Namespace, loss_name: str, device: torch.device,
              updates: list[list[HostBatch]], update_freq: int, micro_tokens: int) -> dict:
    """Warm-up and timed `updates` with the loss `loss_name` from a fresh model (seeded:
    every loss starts from the same weights and draws the same dropout masks); returns
    the figures of the JSON line."""
    precision = opt.precision
    torch.manual_seed(opt.seed)
    cfg = model_preset(opt.arch, vocab_size=opt.vocab)
    model = Transformer(cfg).to(device).train()
    train_cfg = TrainConfig(max_tokens=opt.max_tokens, batch_tokens=opt.batch_tokens,
                            update_freq=1)
    optimizer = build_optimizer(model.parameters(), train_cfg, device)
    schedule = build_schedule(optimizer, cfg.d_model, train_cfg)
    scaler = grad_scaler(device, enabled=precision == "fp16")
    half = HalfWeights(model, pad_vocab=True, rows_linears=device.type == "cuda") \
        if opt.half_weights and precision == "bf16" else None
    net: nn.Module = model if half is None else half.model
    shapes = None
    if opt.compile:  # as nmt train --compile [--cuda-graphs]: per length bucket
        net = compiled(net, cuda_graphs=opt.cuda_graphs)
        shapes = Shapes(micro_tokens, static_rows=opt.cuda_graphs)
    # Warm-up: the --warmup updates, then the timed ones once, untimed: every batch shape
    # of the timed window has then run once with this loss, so first-time kernel set-up
    # (compilation; oneDNN primitives on a CPU, cuBLAS heuristics on CUDA) is not timed. It
    # would otherwise fall on whichever loss runs first (the CPU smoke: 2.5x its step time).
    warm_start = time.perf_counter()
    warm_losses = [train_update(micro, net, model, opt, loss_name, device, precision,
                                optimizer, scaler, schedule, half, shapes)
                   for micro in updates]
    sync(device)
    warm_seconds = time.perf_counter() - warm_start
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    else:
        reset_host_peak()
    timed = updates[opt.warmup:]
    losses = []
    start = time.perf_counter()
    for micro in timed:
        losses.append(train_update(micro, net, model, opt, loss_name, device, precision,
                                   optimizer, scaler, schedule, half, shapes))
    sync(device)
    seconds = time.perf_counter() - start
    flat = [hb for micro in timed for hb in micro]
    src_tokens = int(sum(hb.src_lens.sum() for hb in flat))
    tgt_tokens = int(sum(hb.tgt_lens.sum() for hb in flat))
    padded = int(sum(hb.batch.src.numel() + hb.batch.tgt_in.numel() for hb in flat))
    params = split_params(model)
    model_flops = 6.0 * (params["encoder"] * src_tokens
                         + (params["decoder"] + params["output_projection"]) * tgt_tokens)
    naive_flops = 6.0 * params["total"] * (src_tokens + tgt_tokens)
    attn_flops = attention_flops(model, flat)
    peak, peak_label = device_peak(device, opt.peak_tflops)

    def mfu(flops: float) -> float | None:
        return None if peak is None else flops / seconds / (peak * 1e12)

    loss_values = torch.stack(losses).float().tolist()
    tokens_per_s = (src_tokens + tgt_tokens) / seconds
    result = {
        "bench": "gpu_train_speed", "smoke": opt.smoke, "arch": opt.arch,
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "torch": torch.__version__, "precision": precision, "loss": loss_name,
        "chunk_rows": None if loss_name == "reference" else opt.chunk_rows,
        "compile": opt.compile, "cuda_graphs": opt.compile and opt.cuda_graphs,
        "half_weights": half is not None, "vocab": opt.vocab, "max_tokens": opt.max_tokens,
        "gpus": opt.gpus, "batch_tokens": None if opt.update_freq else opt.batch_tokens,
        "micro_tokens": micro_tokens,
        "update_freq": update_freq, "warmup_updates": len(updates), "updates": len(timed),
        "params": params, "src_tokens": src_tokens, "tgt_tokens": tgt_tokens,
        "padded_tokens": padded, "padding_fraction": 1 - (src_tokens + tgt_tokens) / padded,
        "mean_src_pieces": src_tokens / sum(len(hb.src_lens) for hb in flat) - 1,
        "seconds": seconds, "warmup_seconds": warm_seconds,
        "step_time_s": seconds / len(timed),
        "tokens_per_s": tokens_per_s,
        "tgt_tokens_per_s": tgt_tokens / seconds,
        "tokens_per_s_all_gpus_no_comm": opt.gpus * tokens_per_s,
        "model_tflops": model_flops / seconds / 1e12,
        "attention_tflops": attn_flops / seconds / 1e12,
        "peak_tflops": peak, "peak_source": peak_label,
        "mfu": mfu(model_flops), "mfu_with_attention": mfu(model_flops + attn_flops),
        "mfu_6n_all_tokens": mfu(naive_flops),
        "loss_per_token_first_last": [loss_values[0], loss_values[-1]],
        # The very first update's: same weights, batch and dropout masks for every loss.
        "loss_per_token_first_update": float(warm_losses[0]),
        "finite": all(math.isfinite(v) for v in loss_values),
    }
    if opt.profile:
        result["profile"] = profile_updates(timed[:2], lambda micro: train_update(
            micro, net, model, opt, loss_name, device, precision, optimizer, scaler,
            schedule, half, shapes), device)
    if device.type == "cuda":
        result["peak_memory_allocated_gib"] = torch.cuda.max_memory_allocated(device) / 2 ** 30
        result["peak_memory_reserved_gib"] = torch.cuda.max_memory_reserved(device) / 2 ** 30
    else:
        result["peak_host_rss_gib"] = peak_host_rss() / 2 ** 30
    return result


# What differs from one loss to the next: `by_loss` carries these for each loss.
PER_LOSS_KEYS = ("chunk_rows", "seconds", "warmup_seconds", "step_time_s", "tokens_per_s",
                 "tgt_tokens_per_s", "tokens_per_s_all_gpus_no_comm", "model_tflops",
                 "attention_tflops", "mfu", "mfu_with_attention", "mfu_6n_all_tokens",
                 "loss_per_token_first_last", "loss_per_token_first_update", "finite",
                 "peak_memory_allocated_gib",
                 "peak_memory_reserved_gib", "peak_host_rss_gib", "profile")


def peak_memory_gib(r: dict) -> float:
    """The peak shown per loss: CUDA allocated, else host RSS (indicative only)."""
    return r.get("peak_memory_allocated_gib", r.get("peak_host_rss_gib", float("nan")))


def compare(results: list[dict], device: torch.device) -> dict:
    """One JSON line for several losses: the first loss's figures under the usual keys,
    every loss's under `by_loss`, and what `--fused-loss auto` needs to be decided from."""
    first = results[0]
    by_loss = {r["loss"]: {k: r[k] for k in PER_LOSS_KEYS if k in r} for r in results}
    fastest = min(results, key=lambda r: r["step_time_s"])["loss"]
    auto = "fused" if fused_loss_enabled("auto", device) else "reference"
    first_losses = [r["loss_per_token_first_update"] for r in results]
    on_cuda = device.type == "cuda"  # a CPU's peak RSS is the process's, not one loss's
    return {
        **first,
        "losses": [r["loss"] for r in results],
        "by_loss": by_loss,
        "fastest_loss": fastest,
        "step_time_vs_first": {r["loss"]: r["step_time_s"] / first["step_time_s"]
                               for r in results},
        "lowest_memory_loss": (min(results, key=peak_memory_gib)["loss"] if on_cuda
                               else None),
        "peak_memory_vs_first": ({r["loss"]: peak_memory_gib(r) / peak_memory_gib(first)
                                  for r in results} if on_cuda else None),
        "first_update_loss_max_abs_diff": max(first_losses) - min(first_losses),
        "auto_fused_loss": auto,
        "auto_is_fastest": auto == fastest if auto in by_loss else None,
    }


def in_common_buckets(batches: list[HostBatch], keep: int, count: int) -> list[HostBatch]:
    """The first `count` of `batches` whose length bucket (nmt/train/buckets.py) is among
    the `keep` most common: a compiled run's warm-up then compiles `keep` graphs, not one
    per bucket of the WMT-like lengths (the GPU session's time)."""
    def bucket(hb: HostBatch) -> int:
        return bucket_length(max(hb.batch.src.size(1), hb.batch.tgt_in.size(1)))

    common = [b for b, _ in Counter(bucket(hb) for hb in batches).most_common(keep)]
    kept = [hb for hb in batches if bucket(hb) in common]
    return (kept * (count // max(1, len(kept)) + 1))[:count]


def plan_max_tokens(opt: argparse.Namespace, device: torch.device) -> dict[str, Any]:
    """--max-tokens 0: `nmt train`'s micro-batch plan (nmt/train/micro_batch.py) for this
    arch, loss and weights on `device`: measured on CUDA, DEFAULT_TOKENS elsewhere."""
    if device.type != "cuda":
        return {"micro_tokens": micro_batch.DEFAULT_TOKENS, "measured": False}
    cfg = model_preset(opt.arch, vocab_size=opt.vocab)
    model = Transformer(cfg).to(device)
    half = HalfWeights(model, pad_vocab=True, rows_linears=True) \
        if opt.half_weights and opt.precision == "bf16" else None
    compute = model if half is None else half.model
    loss = LossOptions(LABEL_SMOOTHING, cfg.pad_id, fused=opt.losses[0] != "reference",
                       chunk_rows=opt.chunk_rows)
    try:
        plan = micro_batch.plan_on_cuda(model, compute, loss, opt.precision, half is not None,
                                        MAX_LEN, opt.batch_tokens, opt.gpus, device)
    finally:
        del model, compute, half
        release(device, False)
    return {"micro_tokens": plan.micro_tokens, "measured": True,
            "bytes_per_token": plan.bytes_per_token, "static_bytes": plan.static_bytes,
            "device_bytes": plan.device_bytes, "note": plan.describe()}


def run(opt: argparse.Namespace) -> dict:
    """Build the batches once, time each loss of `opt.losses` on them, return the figures
    (one loss: its own; several: `compare`'s)."""
    device = resolve_device(opt.device)
    if opt.precision == "fp32":
        allow_tf32(device)
    plan = None
    if opt.max_tokens == 0:  # as nmt train --max-tokens 0: planned from the GPU's memory
        plan = plan_max_tokens(opt, device)
        opt.max_tokens = plan["micro_tokens"]
    update_freq, micro_tokens, fill = update_shape(opt)
    batches = make_batches((opt.warmup + opt.steps) * update_freq * (4 if opt.max_buckets
                                                                     else 1),
                           micro_tokens, opt.vocab, opt.seed)
    if opt.max_buckets:  # the batches of the most common length buckets alone
        batches = in_common_buckets(batches, opt.max_buckets,
                                    (opt.warmup + opt.steps) * update_freq)
    if device.type == "cuda":
        for hb in batches:
            hb.batch = Batch(hb.batch.src.pin_memory(), hb.batch.tgt_in.pin_memory(),
                             hb.batch.tgt_out.pin_memory(), hb.batch.src_tokens,
                             hb.batch.tgt_tokens)
    updates = [batches[i:i + update_freq] for i in range(0, len(batches), update_freq)]
    results = []
    for name in opt.losses:
        results.append(time_loss(opt, name, device, updates, update_freq, micro_tokens))
        results[-1]["fill"] = fill  # real tokens per side per micro-batch / micro_tokens
        results[-1]["micro_batch_plan"] = plan
        results[-1]["max_buckets"] = opt.max_buckets
        release(device, opt.compile)
    return results[0] if len(results) == 1 else compare(results, device)


def print_table(r: dict) -> None:
    """Human-readable summary on stdout (the JSON line follows)."""
    def pct(v: float | None) -> str:
        return "n/a" if v is None else f"{100 * v:.1f}%"

    memory = (f"{r['peak_memory_allocated_gib']:.2f} GiB allocated, "
              f"{r['peak_memory_reserved_gib']:.2f} GiB reserved"
              if "peak_memory_allocated_gib" in r else f"{r['peak_host_rss_gib']:.2f} GiB RSS")
    rows = [
        ("device", f"{r['device']} (torch {r['torch']})"),
        ("setting", f"{r['arch']}, {r['precision']}, loss {r['loss']}"
                    f"{', compiled' if r['compile'] else ''}"),
        ("params", f"{r['params']['total'] / 1e6:.1f} M (encoder "
                   f"{r['params']['encoder'] / 1e6:.1f}, decoder "
                   f"{r['params']['decoder'] / 1e6:.1f}, output projection "
                   f"{r['params']['output_projection'] / 1e6:.1f})"),
        ("batches", f"{r['update_freq']} x {r['micro_tokens']} tokens per update"
                    + (f" (one GPU of {r['gpus']}: batch-tokens {r['batch_tokens']}, "
                       f"max-tokens {r['max_tokens']})" if r["batch_tokens"] else "")
                    + "; "
                    f"{r['updates']} timed after {r['warmup_updates']} warm-up; "
                    f"padding {100 * r['padding_fraction']:.1f}%; "
                    f"mean source {r['mean_src_pieces']:.1f} pieces per sentence"),
        ("step time", f"{1000 * r['step_time_s']:.1f} ms per update"),
        ("tokens/s", f"{r['tokens_per_s']:,.0f} source+target ({r['tgt_tokens_per_s']:,.0f} "
                     "target)"),
        ("model TFLOP/s", f"{r['model_tflops']:.1f} (+ attention {r['attention_tflops']:.1f})"),
        ("peak", f"{r['peak_tflops'] or 'n/a'} TFLOP/s dense bf16: {r['peak_source']}"),
        ("MFU", f"{pct(r['mfu'])} (with attention {pct(r['mfu_with_attention'])}; "
                f"6 x params x all tokens: {pct(r['mfu_6n_all_tokens'])})"),
        ("peak memory", memory),
        ("loss/token", f"{r['loss_per_token_first_last'][0]:.3f} -> "
                       f"{r['loss_per_token_first_last'][1]:.3f}"),
    ]
    if r["gpus"] > 1:
        rows.insert(6, ("x GPUs", f"{r['tokens_per_s_all_gpus_no_comm']:,.0f} tokens/s for "
                                  f"{r['gpus']} (upper bound: all-reduce not timed)"))
    for name, value in rows:
        print(f"{name:<14}{value}")


def print_comparison(r: dict) -> None:
    """The losses side by side (after each loss's table), for --fused-loss auto."""
    print(f"{'loss':<16}{'step ms':>9}{'vs first':>10}{'tokens/s':>12}{'peak GiB':>10}"
          f"{'first loss':>12}")
    for name, figures in r["by_loss"].items():
        print(f"{name:<16}{1000 * figures['step_time_s']:>9.1f}"
              f"{r['step_time_vs_first'][name]:>9.2f}x{figures['tokens_per_s']:>12,.0f}"
              f"{peak_memory_gib(figures):>10.2f}"
              f"{figures['loss_per_token_first_update']:>12.4f}")
    verdict = ("n/a (not compared)" if r["auto_is_fastest"] is None
               else "the faster" if r["auto_is_fastest"] else "NOT the faster")
    lowest = r["lowest_memory_loss"] or "n/a (CPU: peak RSS is the process's)"
    print(f"fastest {r['fastest_loss']}, lowest peak memory {lowest}; "
          f"--fused-loss auto picks {r['auto_fused_loss']} on {r['device']}: {verdict}; "
          f"first-update loss spread {r['first_update_loss_max_abs_diff']:.2g}")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The flags (defaults: the WMT recipe's batching), with `losses` (the --loss list) and
    --smoke's sizes applied; a bad --loss / --gpus combination is a usage error."""
    recipe = load_recipe("wmt14-en-de").training
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", default="base", choices=["base", "big", "small", "tiny"])
    parser.add_argument("--steps", type=int, default=20, help="timed updates")
    parser.add_argument("--warmup", type=int, default=5,
                        help="untimed first updates (the timed ones also run once untimed "
                        "before they are timed)")
    parser.add_argument("--compile", action="store_true",
                        help="torch.compile the model as nmt train --compile does: batches "
                        "padded to length buckets, one graph per bucket")
    parser.add_argument("--cuda-graphs", action="store_true",
                        help="with --compile: static shapes, each bucket's step replayed as "
                        "a CUDA graph (nmt train --cuda-graphs)")
    parser.add_argument("--max-buckets", type=int, default=0,
                        help="time only batches of the K most common length buckets (a "
                        "compiled run then compiles K graphs: the GPU session's time); 0: all")
    parser.add_argument("--half-weights", action="store_true",
                        help="bf16: compute on a bf16 copy with fp32 master weights, the "
                        "output matrix padded to 64 rows, transposed linear weights on CUDA "
                        "(nmt train's default on CUDA); else fp32 weights under autocast")
    parser.add_argument("--loss", default="reference",
                        help="reference | fused | fused-compiled, a comma-separated list of "
                        "them, both (reference,fused) or all: several are timed one after "
                        "the other and compared")
    parser.add_argument("--gpus", type=int, default=1,
                        help="time one GPU's shape of an N-GPU run (derive_batching on "
                        "WMT-like lengths: 8 is 1 x 3,308 tokens per GPU); all-reduce not "
                        "timed")
    parser.add_argument("--chunk-rows", type=int, default=DEFAULT_CHUNK_ROWS,
                        help="rows per chunk of the fused loss")
    parser.add_argument("--precision", default="bf16", choices=["bf16", "fp16", "fp32"])
    parser.add_argument("--device", default="auto", choices=["auto", "cuda", "cpu"])
    parser.add_argument("--max-tokens", type=int, default=12500,
                        help="cap on padded tokens per micro-batch per GPU (12,500: what the "
                        "H200 figures ran with); 0: planned from the GPU's memory, as the "
                        "WMT recipes' nmt train does")
    parser.add_argument("--batch-tokens", type=int, default=int(recipe["batch_tokens"]),
                        help="real tokens per side per update over all GPUs; update-freq "
                        "and tokens per micro-batch derived for --gpus")
    parser.add_argument("--update-freq", type=int, default=0,
                        help="micro-batches of --max-tokens per update (0: derived from "
                        "--batch-tokens and --gpus)")
    parser.add_argument("--vocab", type=int, default=VOCAB)
    parser.add_argument("--peak-tflops", type=float, default=None,
                        help="dense bf16 peak of the device, overriding the table")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--profile", action="store_true",
                        help="run the timed updates once more under torch.profiler: device "
                        "busy fraction, kernel launches, top kernels")
    parser.add_argument("--count-ops", action="store_true",
                        help="count, on the CPU along the GPU's code path, the ops base and "
                        "big dispatch per micro-batch for each lever, compiled graphs and "
                        "breaks, and the planned micro-batch on 80 GB and 141 GB GPUs "
                        "(bench/_count_ops.py); nothing is timed")
    parser.add_argument("--json-out", type=Path, default=None,
                        help="with --count-ops: also write the counts there (the input of "
                        "bench/gpu_model.py)")
    parser.add_argument("--no-compile-count", action="store_true",
                        help="with --count-ops: leave out the compiled levers (minutes)")
    record.add_argument(parser, "gpu-train")
    parser.add_argument("--smoke", action="store_true",
                        help="CPU, tiny model, vocab 1000, max-tokens 1024, batch-tokens "
                        "2048, 1+2 updates per loss")
    opt = parser.parse_args(argv)
    try:
        opt.losses = loss_list(opt.loss)
    except ValueError as err:
        parser.error(str(err))
    if opt.gpus < 1:
        parser.error("--gpus must be >= 1")
    if opt.gpus > 1 and opt.update_freq:
        parser.error("--gpus derives the update's shape from --batch-tokens: leave out "
                     "--update-freq")
    if opt.smoke:
        opt.arch, opt.device, opt.vocab, opt.max_tokens = "tiny", "cpu", 1000, 1024
        opt.batch_tokens, opt.update_freq, opt.steps, opt.warmup = 2048, 0, 2, 1
        # One thread: on a shared CI machine, OpenMP threads spinning against other jobs
        # make a tiny step take seconds instead of milliseconds.
        torch.set_num_threads(1)
    return opt


def loss_list(text: str) -> list[str]:
    """--loss as the losses to time, in order: names of LOSSES separated by commas, `both`
    (reference, fused: what --fused-loss off / on train with) or `all`."""
    names: list[str] = []
    for part in text.split(","):
        for name in LOSS_ALIASES.get(part.strip(), (part.strip(),)):
            if name not in LOSSES:
                raise ValueError(f"--loss: unknown {name!r}; choose from "
                                 f"{', '.join((*LOSSES, *LOSS_ALIASES))}")
            if name not in names:
                names.append(name)
    return names


def count_ops(opt: argparse.Namespace) -> None:
    """--count-ops: the tables, --json-out, and the JSON line."""
    import _count_ops

    archs = ["tiny"] if opt.smoke else (["base", "big"] if opt.arch == "base" else [opt.arch])
    torch.set_num_threads(max(1, torch.get_num_threads()))
    result = _count_ops.run(archs, opt.vocab, opt.batch_tokens, opt.max_tokens,
                            not opt.no_compile_count, lambda line: print(line, flush=True))
    _count_ops.print_tables(result)
    if opt.json_out is not None:
        opt.json_out.write_text(json.dumps(result))
    from nmt.doctor import report as machine
    print(json.dumps({"bench": "gpu_train_speed_count_ops", **result,
                      "doctor": machine(measure=False)}))


def main() -> None:
    """Parse the flags, time, print each loss's table (and the comparison), then the JSON
    line."""
    opt = parse_args()
    if opt.count_ops:
        count_ops(opt)
        return
    result = run(opt)
    if "by_loss" in result:
        for name in result["losses"]:
            print(f"--- loss {name}")
            print_table({**result, **result["by_loss"][name], "loss": name})
        print("---")
        print_comparison(result)
    else:
        print_table(result)
    for name in result.get("losses", [result["loss"]]):
        figures = result.get("by_loss", {}).get(name, result)
        if figures.get("profile"):
            print(f"--- profile, loss {name}")
            print_profile(figures["profile"], figures["step_time_s"])
    from nmt.doctor import report as machine  # beside every figure
    doctor = machine(measure=False)
    print(json.dumps({**result, "doctor": doctor}))
    record.write(records(result, doctor), opt.record)


def records(result: dict, doctor: dict) -> list[dict]:
    """One gpu-train record (bench/results/README.md) per loss timed."""
    mode = ("compiled" if result["compile"] else "eager") + (
        ", CUDA graphs" if result["cuda_graphs"] else "") + (
        ", bf16 weights" if result["half_weights"] else "")
    run = record.run_id()
    found = []
    for name in result.get("losses", [result["loss"]]):
        fig = result.get("by_loss", {}).get(name, result)
        memory = fig.get("peak_memory_allocated_gib", fig.get("peak_host_rss_gib"))
        settings = {"arch": result["arch"], "precision": result["precision"], "mode": mode,
                    "vocab": result["vocab"], "gpus": result["gpus"],
                    "shape": f"{result['update_freq']} x {result['micro_tokens']:,} tokens"
                             + (" per GPU, one GPU's share, all-reduce not timed"
                                if result["gpus"] > 1 else ""),
                    "loss": name, "device": result["device"], "smoke": result["smoke"]}
        figures = {"step_time_ms": 1000 * fig["step_time_s"],
                   "tokens_per_s": fig["tokens_per_s"], "mfu": fig.get("mfu"),
                   "model_tflops": fig.get("model_tflops"), "peak_memory_gib": memory,
                   "peak_bf16_tflops": result.get("peak_tflops"), "updates": result["updates"]}
        found.append(record.make("gpu-train", "nmt", settings, figures, doctor, run=run))
    return found


if __name__ == "__main__":
    main()
