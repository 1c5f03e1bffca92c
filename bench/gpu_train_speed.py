"""Training throughput and MFU of `base` / `big` on one GPU, synthetic WMT-length batches.

What one timed update runs: `train_step` and `apply_update` (nmt/train/step.py), the
functions `nmt train` runs, with batches collated ahead as a prefetching loop would have
them: for each of the update's micro-batches, the host-to-device copy, the real
`Transformer` (`--arch` preset, vocabulary 37,000, shared embeddings, dropout as the
preset) under autocast (`--precision`, bf16 by default), only the
non-PAD target rows projected, the label-smoothed loss (eps 0.1) and backward, the
gradient norm; then Adam from `nmt.train.schedule.build_optimizer` (fused on CUDA) with the
paper's schedule (the Trainer's finiteness check is left out: it is the update's host sync).
`--loss reference` is today's path (`model(..., select=rows)` logits +
`label_smoothed_nll`); `--loss fused` projects the decoder features with the chunked
`projected_smoothed_loss` (no (rows, V) tensor), `--loss fused-compiled` the same with its
per-chunk softmax and gradient kernels torch.compile'd. `--compile` wraps the model in
`torch.compile`; warm-up updates absorb compilation.

Batches: source lengths drawn log-normally like WMT14 En-De BPE pieces (mean about 27,
long tail cut at 255 so pairs fit `max_len` 256 with EOS), target length = source x a
log-normal ratio around 1.05; grouped by the project's own `batch_by_tokens` at the WMT
recipe's per-GPU `[training] max_tokens` (12,500) and `update_freq` from its
`batch_tokens` for one GPU (`derive_batching`: 2 x 12,500), then shuffled. Token ids are
random (speed does not depend on them).

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
and decoder is not useful work, so it lowers MFU.

    .venv/bin/python bench/gpu_train_speed.py --arch base [--compile] [--loss fused]
    .venv/bin/python bench/gpu_train_speed.py --smoke      # CPU, tiny model, 2 updates
Prints a table and one JSON line.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch import Tensor, nn

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from nmt.config import TrainConfig, model_preset  # noqa: E402
from nmt.data.batching import Batch, batch_by_tokens, collate  # noqa: E402
from nmt.data.recipes import load_recipe  # noqa: E402
from nmt.device import allow_tf32, resolve_device  # noqa: E402
from nmt.model.transformer import Transformer  # noqa: E402
from nmt.precision import grad_scaler  # noqa: E402
from nmt.train.feed import to_device  # noqa: E402
from nmt.train.loop import derive_batching  # noqa: E402
from nmt.train.loss import DEFAULT_CHUNK_ROWS, target_positions  # noqa: E402
from nmt.train.schedule import Schedule, build_optimizer, build_schedule  # noqa: E402
from nmt.train.step import LossOptions, apply_update, train_step  # noqa: E402

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
MAX_LEN = 256  # pieces + EOS, TrainConfig's max_len


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
    cfg = model.cfg
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


def train_update(micro: list[HostBatch], net: nn.Module, model: Transformer,
                 opt: argparse.Namespace, device: torch.device, precision: str,
                 optimizer: torch.optim.Optimizer, scaler: torch.amp.GradScaler,
                 schedule: Schedule) -> Tensor:
    """One update over `micro` through `train_step` and `apply_update` (what `nmt train`
    runs); returns the mean token loss as a device scalar (no host sync: the update is
    applied as finite, the Trainer's check needs the sync this bench leaves out)."""
    tokens = sum(int(hb.tgt_lens.sum()) for hb in micro)
    loss = LossOptions(LABEL_SMOOTHING, model.cfg.pad_id, fused=opt.loss != "reference",
                       chunk_rows=opt.chunk_rows, compiled=opt.loss == "fused-compiled")
    on_device = [to_device(hb.batch, hb.has_pad,
                           None if hb.select is None else torch.from_numpy(hb.select), device)
                 for hb in micro]  # as the Trainer's feed hands them over
    step = train_step(net, model, on_device, tgt_tokens=tokens,
                      optimizer=optimizer, scaler=scaler, precision=precision, loss=loss)
    apply_update(optimizer, scaler, schedule, precision, finite=True)
    return step.loss_sum / tokens


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def run(opt: argparse.Namespace) -> dict:
    """Build model and batches, run warm-up and timed updates, return the figures."""
    device = resolve_device(opt.device)
    precision = opt.precision
    if precision == "fp32":
        allow_tf32(device)
    torch.manual_seed(opt.seed)
    cfg = model_preset(opt.arch, vocab_size=opt.vocab)
    model = Transformer(cfg).to(device).train()
    train_cfg = TrainConfig(max_tokens=opt.max_tokens, batch_tokens=opt.batch_tokens,
                            update_freq=1)
    update_freq = opt.update_freq or derive_batching(train_cfg, 1).update_freq
    optimizer = build_optimizer(model.parameters(), train_cfg, device)
    schedule = build_schedule(optimizer, cfg.d_model, train_cfg)
    scaler = grad_scaler(device, enabled=precision == "fp16")
    net: nn.Module = model
    if opt.compile:
        net = torch.compile(net)
    batches = make_batches((opt.warmup + opt.steps) * update_freq, opt.max_tokens, opt.vocab,
                           opt.seed)
    if device.type == "cuda":
        for hb in batches:
            hb.batch = Batch(hb.batch.src.pin_memory(), hb.batch.tgt_in.pin_memory(),
                             hb.batch.tgt_out.pin_memory(), hb.batch.src_tokens,
                             hb.batch.tgt_tokens)
    updates = [batches[i:i + update_freq] for i in range(0, len(batches), update_freq)]
    warm_start = time.perf_counter()
    for micro in updates[:opt.warmup]:
        train_update(micro, net, model, opt, device, precision, optimizer, scaler, schedule)
    sync(device)
    warm_seconds = time.perf_counter() - warm_start
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    timed = updates[opt.warmup:]
    losses = []
    start = time.perf_counter()
    for micro in timed:
        losses.append(train_update(micro, net, model, opt, device, precision, optimizer,
                                   scaler, schedule))
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
    result = {
        "bench": "gpu_train_speed", "smoke": opt.smoke, "arch": opt.arch,
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "torch": torch.__version__, "precision": precision, "loss": opt.loss,
        "chunk_rows": None if opt.loss == "reference" else opt.chunk_rows,
        "compile": opt.compile, "vocab": opt.vocab, "max_tokens": opt.max_tokens,
        "update_freq": update_freq, "warmup_updates": opt.warmup, "updates": len(timed),
        "params": params, "src_tokens": src_tokens, "tgt_tokens": tgt_tokens,
        "padded_tokens": padded, "padding_fraction": 1 - (src_tokens + tgt_tokens) / padded,
        "mean_src_pieces": src_tokens / sum(len(hb.src_lens) for hb in flat) - 1,
        "seconds": seconds, "warmup_seconds": warm_seconds,
        "step_time_s": seconds / len(timed),
        "tokens_per_s": (src_tokens + tgt_tokens) / seconds,
        "tgt_tokens_per_s": tgt_tokens / seconds,
        "model_tflops": model_flops / seconds / 1e12,
        "attention_tflops": attn_flops / seconds / 1e12,
        "peak_tflops": peak, "peak_source": peak_label,
        "mfu": mfu(model_flops), "mfu_with_attention": mfu(model_flops + attn_flops),
        "mfu_6n_all_tokens": mfu(naive_flops),
        "loss_per_token_first_last": [loss_values[0], loss_values[-1]],
        "finite": all(math.isfinite(v) for v in loss_values),
    }
    if device.type == "cuda":
        result["peak_memory_allocated_gib"] = torch.cuda.max_memory_allocated(device) / 2 ** 30
        result["peak_memory_reserved_gib"] = torch.cuda.max_memory_reserved(device) / 2 ** 30
    else:
        result["peak_host_rss_gib"] = peak_host_rss() / 2 ** 30
    return result


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
        ("batches", f"{r['update_freq']} x max-tokens {r['max_tokens']} per update; "
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
    for name, value in rows:
        print(f"{name:<14}{value}")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    recipe = load_recipe("wmt14-en-de").training
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", default="base", choices=["base", "big", "small", "tiny"])
    parser.add_argument("--steps", type=int, default=20, help="timed updates")
    parser.add_argument("--warmup", type=int, default=5, help="untimed first updates")
    parser.add_argument("--compile", action="store_true", help="torch.compile the model")
    parser.add_argument("--loss", default="reference",
                        choices=["reference", "fused", "fused-compiled"])
    parser.add_argument("--chunk-rows", type=int, default=DEFAULT_CHUNK_ROWS,
                        help="rows per chunk of the fused loss")
    parser.add_argument("--precision", default="bf16", choices=["bf16", "fp16", "fp32"])
    parser.add_argument("--device", default="auto", choices=["auto", "cuda", "cpu"])
    parser.add_argument("--max-tokens", type=int, default=int(recipe["max_tokens"]),
                        help="padded tokens per micro-batch (the WMT recipe's per-GPU value)")
    parser.add_argument("--batch-tokens", type=int, default=int(recipe["batch_tokens"]),
                        help="tokens per update; update-freq derived for one GPU")
    parser.add_argument("--update-freq", type=int, default=0,
                        help="micro-batches per update (0: derived from --batch-tokens)")
    parser.add_argument("--vocab", type=int, default=VOCAB)
    parser.add_argument("--peak-tflops", type=float, default=None,
                        help="dense bf16 peak of the device, overriding the table")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--smoke", action="store_true",
                        help="CPU, tiny model, vocab 1000, max-tokens 512, 1+2 updates")
    opt = parser.parse_args(argv)
    if opt.smoke:
        opt.arch, opt.device, opt.vocab, opt.max_tokens = "tiny", "cpu", 1000, 512
        opt.batch_tokens, opt.update_freq, opt.steps, opt.warmup = 512, 1, 2, 1
        # One thread: on a shared CI machine, OpenMP threads spinning against other jobs
        # make a tiny step take seconds instead of milliseconds.
        torch.set_num_threads(1)
    return opt


def main() -> None:
    opt = parse_args()
    result = run(opt)
    print_table(result)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
