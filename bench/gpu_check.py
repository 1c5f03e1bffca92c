"""GPU check: the paper's workload path on CUDA, end to end, in one command.

Run it in any session that has a GPU (it needs nothing but this checkout and
../shared/data/multi30k):

    .venv/bin/python bench/gpu_check.py                # CUDA: about 10 minutes on an H100
    .venv/bin/python bench/gpu_check.py --dry-run      # CPU, toy sizes: what CI runs

Each check drives the real `nmt` commands (subprocesses of `python -m nmt.cli.main`) or the
real training loop in-process, on Multi30k prepared and BPE-encoded by `nmt prep` /
`nmt bpe` into --out:

- train_bf16 / train_fp16: `nmt train` with the Multi30k recipe for --updates updates in
  bf16 and fp16 (loss scaling); train_cpu_fp32: the same flags on the CPU in fp32. The GPU
  runs must track the CPU run: mean |loss difference| over the second half of the logged
  updates at most --loss-tol nats.
- resume: a bf16 run killed with SIGKILL after its first checkpoint and run again with the
  same command ends at the same update as an uninterrupted run, with the same loss (to
  --loss-tol / 10: CUDA kernels are not bitwise deterministic).
- translate_fp32/bf16/fp16: `nmt translate` of test2016 on CUDA at each precision; sacreBLEU
  within 0.3 of the CPU fp32 translation of the same model. Sentences/s reported.
- nbest, sampling, ensemble, attention: `--nbest 4` gives 4 well-formed lines per input,
  `--sampling --seed S` twice gives identical output (another seed does not), a 2-model
  ensemble keeps one line per input, `--attention DIR` writes a heatmap per line.
- host_syncs: one training run in-process under `torch.cuda.set_sync_debug_mode("warn")`;
  every synchronising CUDA call is listed by its nmt call site, with its count per update.
- big_memory: peak GPU memory (allocated and reserved) of `--arch big` (vocab 37,000) for
  training updates at the WMT recipe's per-GPU max_tokens, typical (32-token) and worst-case
  (256-token) sentences.
- shape_8gpu: one GPU's share of an 8-GPU run of the WMT recipe, `base` in bf16: 1 x 3,308
  tokens per update (`derive_batching` on the bench's WMT-like lengths, not the 1-GPU
  3 x 8,805), timed by
  `bench/gpu_train_speed.py --gpus 8 --loss both` with the reference and the fused loss one
  after the other: step time, tokens/s and peak memory of each, which is faster, and
  whether `--fused-loss auto` (fused on CUDA) picks it. The all-reduce is not timed. Fails
  when the shape is not the derived one, a loss is not finite, or the two losses' first
  updates differ by more than 0.05 nats (they compute the same function).
- torchrun_2proc: `nmt train --gpus 2` / `--nproc 2` (its self-relaunch under
  `torch.distributed.run --standalone --nproc_per_node 2`), `--fused-loss on` (the 8-GPU
  combination: DDP and the fused loss) and `--batch-tokens` (update-freq derived for 2
  processes from the data's measured fill). It must exit 0 with every logged update at
  world_size 2 and the derived update-freq, and leave checkpoint_last.pt at the last
  update holding both ranks' RNG states (both reached the save) that loads into the
  model. With 2 or more GPUs visible: NCCL, 2 GPUs, bf16, the Multi30k recipe's model.
  With one GPU (NCCL cannot put two ranks on one device) and in --dry-run: 2 gloo
  processes on the CPU, tiny model, fp32: the check says so in its detail and
  `data.backend` / `data.on_gpu`; the NCCL path is then not exercised.

Prints a table and one JSON line; exits 1 when a check fails. --dry-run runs every step on
the CPU at toy size (CUDA-only figures are reported as n/a; the shape and torchrun checks
run on the CPU and say so: their timings are CPU figures) so the script cannot rot.
`--only shape_8gpu,torchrun_2proc` runs some checks (resume, translate and decoding use
the training checks' runs); `--data DIR` takes an already prepared and BPE-encoded DATA.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
import traceback
import warnings
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
SHARED = Path(os.environ.get("NMT_SHARED_DATA", REPO.parent / "shared" / "data"))


@dataclass
class Check:
    """One row of the report."""

    name: str
    status: str = "ok"  # ok | FAIL | n/a
    figure: str = ""
    detail: str = ""
    data: dict[str, Any] = field(default_factory=dict)


@dataclass
class Setup:
    """What every check shares: device, sizes, paths."""

    dry: bool
    device: str
    out: Path
    data: Path
    updates: int
    lines: int
    loss_tol: float
    python: str = sys.executable

    @property
    def model_flags(self) -> list[str]:
        """Dry run: the tiny shape; else the Multi30k recipe's (small)."""
        return ["--arch", "tiny", "--max-tokens", "512"] if self.dry else []


def run_cli(setup: Setup, *args: str, stdin: bytes | None = None,
            timeout: float = 900, env_extra: dict[str, str] | None = None
            ) -> subprocess.CompletedProcess:
    """`python -m nmt.cli.main ARGS` from the checkout; raises with its stderr on failure."""
    env = {**os.environ, "PYTHONPATH": str(REPO), **(env_extra or {})}
    result = subprocess.run([setup.python, "-m", "nmt.cli.main", *args], input=stdin,
                            capture_output=True, timeout=timeout, env=env, cwd=REPO)
    if result.returncode != 0:
        raise RuntimeError(f"nmt {' '.join(args[:2])} exited {result.returncode}: "
                           f"{result.stderr.decode(errors='replace')[-1500:]}")
    return result


def prepare(setup: Setup) -> None:
    """Multi30k through `nmt prep` (from the local mirror) and `nmt bpe`, once."""
    if (setup.data / "bin").is_dir():
        return
    mirror = SHARED / "multi30k"
    if not (mirror / "train.en").is_file():
        raise SystemExit(f"gpu_check: {mirror} not found (Multi30k is read from "
                         "../shared/data; set NMT_SHARED_DATA)")
    run_cli(setup, "prep", "multi30k-en-de", "-o", str(setup.data), "--mirror", str(mirror))
    run_cli(setup, "bpe", str(setup.data))


def train_losses(run: Path) -> dict[int, float]:
    """update -> train loss from RUN/train_log.jsonl."""
    from nmt.train.log import read_jsonl

    return {r["step"]: r["loss"] for r in read_jsonl(run / "train_log.jsonl")
            if r["kind"] == "train"}


def train_run(setup: Setup, run: Path, device: str, precision: str, *extra: str,
              env_extra: dict[str, str] | None = None) -> Check:
    """`nmt train` for --updates updates; loss and tokens/s from its log."""
    from nmt.train.log import read_jsonl

    start = time.perf_counter()
    run_cli(setup, "train", str(setup.data), "-o", str(run), "--device", device,
            "--precision", precision, "--max-updates", str(setup.updates),
            "--log-interval", str(max(1, setup.updates // 20)), "--valid-interval",
            str(setup.updates), *setup.model_flags, *extra, env_extra=env_extra)
    seconds = time.perf_counter() - start
    records = [r for r in read_jsonl(run / "train_log.jsonl") if r["kind"] == "train"]
    last = records[-1]
    tok_s = sum(r["tokens_per_s"] for r in records[1:]) / max(1, len(records) - 1)
    skipped = last["skipped_updates"]
    return Check(f"train_{precision}" + ("" if device != "cpu" or setup.dry else "_cpu"),
                 figure=f"loss {last['loss']:.3f} at {last['step']}",
                 detail=f"{tok_s:,.0f} tok/s, {skipped} skipped, {seconds:.0f} s",
                 data={"loss": last["loss"], "step": last["step"], "tokens_per_s": tok_s,
                       "skipped_updates": skipped, "seconds": seconds})


def tracks(gpu: dict[int, float], cpu: dict[int, float], tol: float) -> tuple[float, bool]:
    """Mean |loss difference| over the second half of the common logged updates."""
    steps = sorted(set(gpu) & set(cpu))
    tail = steps[len(steps) // 2:]
    if not tail:
        return float("nan"), False
    diff = sum(abs(gpu[s] - cpu[s]) for s in tail) / len(tail)
    return diff, diff <= tol


def check_training(setup: Setup, runs: Path) -> list[Check]:
    """bf16 and fp16 on the device, fp32 on the CPU with the same flags; loss tracking."""
    from concurrent.futures import ThreadPoolExecutor

    def reported(check: Check) -> Check:
        print(f"  ... {check.name}: {check.figure} [{check.detail}]", flush=True)
        return check

    # The CPU reference runs beside the device runs, on all but 4 of the host's cores (a
    # GPU run's host threads must not wait for cores: they set its pace); in a dry run
    # everything is on the CPU, so one after the other.
    threads = {} if setup.device == "cpu" else {
        "OMP_NUM_THREADS": str(max(1, (os.cpu_count() or 8) - 4))}
    with ThreadPoolExecutor(max_workers=1) as pool:
        pending = pool.submit(train_run, setup, runs / "cpu_fp32", "cpu", "fp32",
                              env_extra=threads)
        if setup.device == "cpu":
            pending.result()
        gpu_runs = [reported(train_run(setup, runs / precision, setup.device, precision,
                                       "--save-interval-updates",
                                       str(max(1, setup.updates // 2))))
                    for precision in ("bf16", "fp16")]
        cpu = reported(pending.result())
    checks = []
    cpu.name = "train_cpu_fp32"
    cpu_losses = train_losses(runs / "cpu_fp32")
    for precision, check in zip(("bf16", "fp16"), gpu_runs, strict=True):
        check.name = f"train_{precision}"
        diff, ok = tracks(train_losses(runs / precision), cpu_losses, setup.loss_tol)
        check.figure += f" (CPU fp32 {cpu.data['loss']:.3f}, mean |diff| {diff:.3f})"
        check.data["mean_abs_diff_vs_cpu"] = diff
        check.status = "ok" if ok else "FAIL"
        checks.append(check)
    checks.insert(0, cpu)
    return checks


def check_resume(setup: Setup, runs: Path) -> Check:
    """SIGKILL a bf16 run after its first save, run it again: same end as uninterrupted."""
    from nmt.checkpoint import load_checkpoint

    run = runs / "resume"
    flags = ["train", str(setup.data), "-o", str(run), "--device", setup.device,
             "--precision", "bf16", "--max-updates", str(setup.updates), "--log-interval",
             str(max(1, setup.updates // 20)), "--valid-interval", str(setup.updates),
             "--save-interval-updates", str(max(1, setup.updates // 2)), *setup.model_flags]
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    log = runs / "resume.stderr"
    with log.open("wb") as err:
        proc = subprocess.Popen([setup.python, "-m", "nmt.cli.main", *flags], stderr=err,
                                stdout=subprocess.DEVNULL, env=env, cwd=REPO)
        deadline = time.monotonic() + 600
        while b"saved " not in log.read_bytes() and proc.poll() is None:
            if time.monotonic() > deadline:
                break
            time.sleep(0.05)
        killed = proc.poll() is None
        if killed:
            proc.send_signal(signal.SIGKILL)
        proc.wait()
    killed_at = load_checkpoint(run / "checkpoint_last.pt")["step"]
    run_cli(setup, *flags)
    resumed = load_checkpoint(run / "checkpoint_last.pt")
    whole = load_checkpoint(runs / "bf16" / "checkpoint_last.pt")
    a, b = train_losses(run), train_losses(runs / "bf16")
    end = max(a)
    diff = abs(a[end] - b.get(end, float("nan")))
    same_end = resumed["step"] == whole["step"] == setup.updates
    ok = killed and same_end and diff <= setup.loss_tol / 10
    return Check("resume", "ok" if ok else "FAIL",
                 figure=f"killed at {killed_at}, ended at {resumed['step']}",
                 detail=f"final loss {a[end]:.4f} vs uninterrupted {b.get(end, float('nan')):.4f}",
                 data={"killed": killed, "killed_at": killed_at, "end": resumed["step"],
                       "loss_diff": diff})


def translate(setup: Setup, models: list[Path], source: Path, *flags: str,
              device: str | None = None) -> tuple[list[str], float]:
    """Lines `nmt translate` writes for `source`, and the seconds it took."""
    args = ["translate", "-i", str(source), "--device", device or setup.device]
    for model in models:
        args += ["-m", str(model)]
    start = time.perf_counter()
    result = run_cli(setup, *args, *flags)
    lines = result.stdout.decode("utf-8").split("\n")[:-1]  # one per input line, by \n
    return lines, time.perf_counter() - start


def check_translate(setup: Setup, model: Path, source: Path, refs: list[str]) -> list[Check]:
    """CUDA fp32/bf16/fp16 against the CPU fp32 BLEU of the same model."""
    cpu_hyps, cpu_s = translate(setup, [model], source, "--precision", "fp32", device="cpu")
    from nmt.score import corpus_scores

    reference = corpus_scores(cpu_hyps, refs)["bleu"]
    checks = [Check("translate_cpu_fp32", figure=f"BLEU {reference:.2f}",
                    detail=f"{len(cpu_hyps) / cpu_s:.1f} sent/s incl. start-up",
                    data={"bleu": reference, "seconds": cpu_s})]
    for precision in ("fp32", "bf16", "fp16"):
        if setup.dry and precision == "fp16":
            checks.append(Check("translate_fp16", "n/a", detail="fp16 decoding is CUDA-only"))
            continue
        hyps, seconds = translate(setup, [model], source, "--precision", precision)
        score = corpus_scores(hyps, refs)["bleu"]
        ok = len(hyps) == len(refs) and abs(score - reference) <= 0.3
        checks.append(Check(f"translate_{precision}", "ok" if ok else "FAIL",
                            figure=f"BLEU {score:.2f} (CPU fp32 {reference:.2f})",
                            detail=f"{len(hyps) / seconds:.1f} sent/s incl. start-up",
                            data={"bleu": score, "delta": score - reference,
                                  "seconds": seconds, "lines": len(hyps)}))
    return checks


def check_decoding_modes(setup: Setup, models: list[Path], source: Path,
                         attention_dir: Path) -> list[Check]:
    """--nbest, --sampling with a seed, a 2-model ensemble, --attention."""
    n = len(source.read_text(encoding="utf-8").splitlines())
    lines, _ = translate(setup, models[:1], source, "--nbest", "4")
    index_ok = [int(line.split("\t")[0]) for line in lines] == [i for i in range(n)
                                                               for _ in range(4)]
    checks = [Check("nbest", "ok" if index_ok else "FAIL", figure=f"{len(lines)} lines",
                    detail=f"{n} inputs x 4")]
    one, _ = translate(setup, models[:1], source, "--sampling", "--seed", "7")
    two, _ = translate(setup, models[:1], source, "--sampling", "--seed", "7")
    other, _ = translate(setup, models[:1], source, "--sampling", "--seed", "8")
    ok = one == two and one != other and len(one) == n
    checks.append(Check("sampling", "ok" if ok else "FAIL",
                        figure="same seed: identical" if one == two else "seed not honoured",
                        detail="other seed differs" if one != other else "other seed same"))
    ens, _ = translate(setup, models, source)
    checks.append(Check("ensemble", "ok" if len(ens) == n else "FAIL",
                        figure=f"{len(ens)} lines for {n}", detail=f"{len(models)} models"))
    translate(setup, models[:1], source, "--attention", str(attention_dir))
    maps = sorted(attention_dir.glob("*"))
    checks.append(Check("attention", "ok" if len(maps) >= n else "FAIL",
                        figure=f"{len(maps)} files", detail=str(attention_dir)))
    return checks


def check_host_syncs(setup: Setup, runs: Path) -> Check:
    """In-process training under the CUDA sync debug mode; call sites and counts."""
    import torch

    from nmt.train.loop import Trainer
    from nmt.train.settings import resolve

    updates = max(4, min(50, setup.updates))
    flags = {"max_updates": updates, "valid_interval": 10 ** 6, "log_interval": 10 ** 6,
             "save_interval_minutes": 0.0, "precision": "bf16" if not setup.dry else "fp32"}
    model_cfg, train_cfg, _ = resolve(setup.data, "tiny" if setup.dry else None, {}, flags)
    trainer = Trainer(setup.data, runs / "syncs", model_cfg, train_cfg, setup.device,
                      progress=False)
    sites: Counter[str] = Counter()

    def record(message: Any, category: Any, filename: str, lineno: int, *rest: Any) -> None:
        if "called a synchronizing CUDA operation" not in str(message):
            return
        frames = [f for f in traceback.extract_stack()[:-1] if "/nmt/" in f.filename]
        if frames:
            f = frames[-1]
            sites[f"{Path(f.filename).relative_to(REPO)}:{f.lineno} {f.name}: "
                  f"{(f.line or '').strip()[:60]}"] += 1

    if setup.device == "cpu":
        trainer.run()
        return Check("host_syncs", "n/a", detail="CUDA sync debug mode: needs a GPU")
    before = warnings.showwarning
    warnings.showwarning = record
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("always")
            warnings.showwarning = record
            torch.cuda.set_sync_debug_mode("warn")
            try:
                trainer.run()
            finally:
                torch.cuda.set_sync_debug_mode("default")
    finally:
        warnings.showwarning = before
    # Checkpoint saves copy each state tensor to the host (one sync per tensor, at the
    # end-of-run save): counted apart from the update loop, which should read the host
    # once per update at most (the deferred statistics).
    saves = sum(c for s, c in sites.items() if s.startswith("nmt/checkpoint.py"))
    loop = {s: c / updates for s, c in sites.most_common()
            if not s.startswith("nmt/checkpoint.py")}
    per_update = sum(loop.values())
    return Check("host_syncs", "ok" if per_update <= 1.0 else "FAIL",
                 figure=f"{per_update:.2f} per update in the loop; {saves} in checkpoint "
                 "saves", detail="; ".join(f"{c:.2f}x {s}" for s, c in loop.items())[:2000],
                 data={"updates": updates, "per_update": per_update, "loop_sites": loop,
                       "checkpoint_save_syncs": saves})


def check_big_memory(setup: Setup) -> Check:
    """Peak GPU memory of big training updates at the WMT recipe's per-GPU max_tokens:
    `train_step` + `apply_update` as `nmt train` runs them on a GPU (the chunked projected
    loss: no whole (rows, vocab) logits)."""
    if setup.device == "cpu":
        return Check("big_memory", "n/a", detail="peak GPU memory: needs a GPU")
    import torch

    from nmt.config import TrainConfig, model_preset
    from nmt.data.batching import Batch
    from nmt.data.recipes import load_recipe
    from nmt.model.transformer import Transformer
    from nmt.precision import grad_scaler
    from nmt.train.feed import to_device
    from nmt.train.schedule import build_optimizer
    from nmt.train.step import LossOptions, apply_update, train_step

    max_tokens = int(load_recipe("wmt14-en-de").training["max_tokens"])
    device = torch.device(setup.device)
    model = Transformer(model_preset("big", vocab_size=37000)).to(device)
    optimizer = build_optimizer(model.parameters(), TrainConfig(), device)
    scaler = grad_scaler(device, enabled=False)
    loss = LossOptions(label_smoothing=0.1, pad_id=model.config.pad_id, fused=True)
    peaks = {}
    for length in (32, 256):
        rows = max_tokens // length
        torch.cuda.reset_peak_memory_stats()
        for _ in range(2):
            src = torch.randint(4, 37000, (rows, length))  # on the host, as the feed's
            tgt = torch.randint(4, 37000, (rows, length))
            batch = Batch(src, tgt, tgt, rows * length, rows * length)
            micro = to_device(batch, has_pad=False, select=None, device=device)  # no padding
            train_step(model, model, [micro], tgt_tokens=rows * length, optimizer=optimizer,
                       scaler=scaler, precision="bf16", loss=loss)
            apply_update(optimizer, scaler, finite=True)
        torch.cuda.synchronize()
        peaks[length] = (torch.cuda.max_memory_allocated() / 2 ** 30,
                         torch.cuda.max_memory_reserved() / 2 ** 30)
    total = torch.cuda.get_device_properties(device).total_memory / 2 ** 30
    worst = max(r for _, r in peaks.values())
    return Check("big_memory", "ok" if worst < 0.9 * total else "FAIL",
                 figure=f"{worst:.1f} of {total:.0f} GiB reserved",
                 detail="; ".join(f"len {n}: {a:.1f} GiB allocated, {r:.1f} reserved"
                                  for n, (a, r) in peaks.items())
                 + f" (max_tokens {max_tokens}, bf16)",
                 data={"max_tokens": max_tokens, "total_gib": total,
                       "peaks_gib": {str(n): {"allocated": a, "reserved": r}
                                     for n, (a, r) in peaks.items()}})


# Tolerance between the reference and the fused loss's first-update loss (nats per token):
# the same weights, batch and dropout masks, so only rounding differs (bf16 on CUDA).
SAME_LOSS_TOL = 0.05


def check_shape_8gpu(setup: Setup) -> Check:
    """One GPU of an 8-GPU WMT run (1 x 3,308 tokens, base, bf16), the reference and the
    fused loss timed one after the other by bench/gpu_train_speed.py; dry run: its CPU
    smoke at the same ratio (tiny, 1 x 292 tokens), CPU figures only. The expected shape
    is re-derived from the bench's own WMT-like lengths (`shape_lengths`)."""
    from nmt.config import TrainConfig
    from nmt.data.batch_tokens import derive_batching
    from nmt.data.recipes import load_recipe

    sys.path.insert(0, str(REPO / "bench"))
    from gpu_train_speed import shape_lengths

    shape = ["--smoke"] if setup.dry else ["--arch", "base", "--device", "cuda"]
    args = [str(REPO / "bench" / "gpu_train_speed.py"), "--gpus", "8", "--loss", "both",
            *shape]
    result = subprocess.run([setup.python, *args], capture_output=True, timeout=1200,
                            cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)})
    if result.returncode != 0:
        raise RuntimeError(f"gpu_train_speed.py exited {result.returncode}: "
                           f"{result.stderr.decode(errors='replace')[-1500:]}")
    r = json.loads(result.stdout.decode().strip().splitlines()[-1])
    recipe = load_recipe("wmt14-en-de").training
    cap, batch = ((r["max_tokens"], r["batch_tokens"]) if setup.dry else
                  (int(recipe["max_tokens"]), int(recipe["batch_tokens"])))
    want = derive_batching(TrainConfig(max_tokens=cap, batch_tokens=batch, max_len=256), 8,
                           *shape_lengths())
    ref, fused = r["by_loss"]["reference"], r["by_loss"]["fused"]
    shape_ok = (r["update_freq"], r["micro_tokens"]) == (want.update_freq, want.micro_tokens)
    same = r["first_update_loss_max_abs_diff"] <= SAME_LOSS_TOL
    ok = shape_ok and same and ref["finite"] and fused["finite"]
    on_gpu = r["device"] != "cpu"
    if on_gpu:
        memory = (f"peak allocated: fused {fused['peak_memory_allocated_gib']:.2f} GiB, "
                  f"reference {ref['peak_memory_allocated_gib']:.2f} GiB")
    else:
        memory = "GPU memory n/a (CPU run)"
    auto = ("the faster" if r["auto_is_fastest"] else "NOT the faster")
    where = (f"{r['arch']} {r['precision']} on {r['device']}" if on_gpu else
             f"dry run: CPU smoke, {r['arch']} {r['precision']}; CPU timings, not GPU figures")
    return Check(
        "shape_8gpu", "ok" if ok else "FAIL",
        figure=f"{r['update_freq']} x {r['micro_tokens']} tokens/GPU: fused "
               f"{r['step_time_vs_first']['fused']:.2f}x reference's step time "
               f"({1000 * fused['step_time_s']:.1f} vs {1000 * ref['step_time_s']:.1f} ms)",
        detail=f"{where}; {memory}; --fused-loss auto picks {r['auto_fused_loss']} here: "
               f"{auto}; first-update loss difference "
               f"{r['first_update_loss_max_abs_diff']:.2g} (tolerance {SAME_LOSS_TOL}); "
               f"expected shape {want.update_freq} x {want.micro_tokens}"
               f"{'' if shape_ok else ' (MISMATCH)'}; all-reduce not timed",
        data={"on_gpu": on_gpu, "device": r["device"], "arch": r["arch"],
              "precision": r["precision"], "gpus": r["gpus"],
              "update_freq": r["update_freq"], "micro_tokens": r["micro_tokens"],
              "expected_update_freq": want.update_freq,
              "expected_micro_tokens": want.micro_tokens,
              "fastest_loss": r["fastest_loss"], "auto_fused_loss": r["auto_fused_loss"],
              "auto_is_fastest": r["auto_is_fastest"],
              "lowest_memory_loss": r["lowest_memory_loss"],
              "first_update_loss_max_abs_diff": r["first_update_loss_max_abs_diff"],
              "by_loss": {name: {k: v for k, v in figures.items()
                                 if k in ("step_time_s", "tokens_per_s", "finite",
                                          "peak_memory_allocated_gib",
                                          "peak_memory_reserved_gib")}
                          for name, figures in r["by_loss"].items()}})


@dataclass(frozen=True)
class TorchrunPlan:
    """How the 2-process smoke runs on this machine, and what it can and cannot show."""

    backend: str  # nccl | gloo
    on_gpu: bool
    flags: tuple[str, ...]  # launch, device, precision and model flags of `nmt train`
    max_tokens: int
    batch_tokens: int
    updates: int
    note: str


def torchrun_plan(dry: bool, cuda_devices: int) -> TorchrunPlan:
    """2 GPUs or more: NCCL on 2 GPUs (bf16, the Multi30k recipe's model, 2 x 2,048 tokens
    per GPU per update). One GPU or a dry run: 2 gloo processes on the CPU (tiny, fp32,
    2 x 512 tokens), said in the note: NCCL refuses two ranks on one device."""
    if not dry and cuda_devices >= 2:
        return TorchrunPlan("nccl", True, ("--gpus", "2", "--device", "cuda", "--precision",
                                           "bf16"), 2048, 8192, 40,
                            "NCCL, 2 GPUs, bf16, Multi30k recipe model")
    why = ("dry run" if dry else
           f"{cuda_devices} GPU visible: NCCL needs one GPU per rank, NCCL path not exercised")
    return TorchrunPlan("gloo", False, ("--nproc", "2", "--device", "cpu", "--precision",
                                        "fp32", "--arch", "tiny"), 512, 2048, 8,
                        f"gloo, 2 CPU processes, tiny, fp32 ({why})")


def check_torchrun(setup: Setup, runs: Path) -> Check:
    """`nmt train` in 2 processes under torchrun (see `torchrun_plan`): exits 0, every
    logged update at world_size 2, checkpoint_last.pt at the last update with both ranks'
    RNG states, loadable into the model."""
    import torch

    from nmt.checkpoint import load_model
    from nmt.config import TrainConfig
    from nmt.data.batch_tokens import derive_batching
    from nmt.data.dataset import ParallelData
    from nmt.train.log import read_jsonl

    plan = torchrun_plan(setup.dry, torch.cuda.device_count() if not setup.dry else 0)
    run = runs / "torchrun"
    args = ["train", str(setup.data), "-o", str(run), *plan.flags, "--max-tokens",
            str(plan.max_tokens), "--batch-tokens", str(plan.batch_tokens), "--fused-loss",
            "on", "--max-updates", str(plan.updates), "--log-interval", "1",
            "--valid-interval", str(plan.updates), "--save-interval-updates",
            str(plan.updates // 2)]
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    start = time.perf_counter()
    # A session of its own: on a timeout the launcher and both ranks are killed together.
    proc = subprocess.Popen([setup.python, "-m", "nmt.cli.main", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, env=env, cwd=REPO, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=900)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        raise RuntimeError(f"torchrun smoke ({plan.note}) still running after 900 s: "
                           "killed (a rank hung in a collective?)") from None
    seconds = time.perf_counter() - start
    if proc.returncode != 0:
        raise RuntimeError(f"nmt train ({plan.note}) exited {proc.returncode}: "
                           f"{err.decode(errors='replace')[-1500:]}")
    records = [r for r in read_jsonl(run / "train_log.jsonl") if r["kind"] == "train"]
    worlds = sorted({r["world_size"] for r in records})
    freqs = sorted({r["update_freq"] for r in records})
    _, _, payload = load_model(run / "checkpoint_last.pt")  # raises if it does not load
    # The shape `nmt train` derives: its resolved settings, the data's measured fill.
    train_split = ParallelData.open(setup.data, "train")
    want = derive_batching(TrainConfig.from_dict(payload["train_config"]), 2,
                           train_split.src.lengths, train_split.tgt.lengths)
    rng_states = len(payload.get("rng") or [])
    last = records[-1] if records else {}
    ok = (worlds == [2] and freqs == [want.update_freq] and last.get("step") == plan.updates
          and payload["step"] == plan.updates and rng_states == 2)
    return Check("torchrun_2proc", "ok" if ok else "FAIL",
                 figure=f"2 ranks ({plan.backend}, {'GPU' if plan.on_gpu else 'CPU'}): ended "
                        f"at update {payload['step']} of {plan.updates}, loss "
                        f"{last.get('loss', float('nan')):.3f}",
                 detail=f"{plan.note}; fused loss on; world_size {worlds}, update-freq "
                        f"{freqs} (derived {want.update_freq} x {want.micro_tokens}); "
                        f"checkpoint holds {rng_states} ranks' RNG states; {seconds:.0f} s",
                 data={"backend": plan.backend, "on_gpu": plan.on_gpu, "nproc": 2,
                       "world_sizes": worlds, "update_freqs": freqs,
                       "expected_update_freq": want.update_freq,
                       "micro_tokens": want.micro_tokens, "updates": plan.updates,
                       "step": payload["step"], "rng_states": rng_states,
                       "loss": last.get("loss"), "seconds": seconds})


def guarded(name: str, fn: Any, *args: Any) -> list[Check]:
    """Run one check; an exception becomes a FAIL row instead of ending the script."""
    start = time.perf_counter()
    try:
        result = fn(*args)
    except Exception as err:  # reported as a FAIL row; the other checks still run
        result = [Check(name, "FAIL", detail=f"{type(err).__name__}: {err}"[:1500])]
    rows = result if isinstance(result, list) else [result]
    # Each group's rows as soon as it ends (flushed): a visit's cap that kills this script
    # still leaves what ran in the log.
    print(f"[{time.perf_counter() - start:6.1f} s] {name}: " + "; ".join(
        f"{c.name} {c.status} {c.figure}" for c in rows), flush=True)
    return rows


# What --only chooses from, in the order the checks run.
GROUPS = ("training", "resume", "translate", "decoding", "host_syncs", "big_memory",
          "shape_8gpu", "torchrun_2proc")


def translation_checks(setup: Setup, runs: Path, only: list[str]) -> list[Check]:
    """translate_* and the decoding modes on the bf16 training run's checkpoints, on the
    first --lines lines of DATA/test.src."""
    source = runs / "test.src"
    source.write_text("".join(line + "\n" for line in (setup.data / "test.src").read_text(
        encoding="utf-8").splitlines()[:setup.lines]), encoding="utf-8")
    refs = (setup.data / "test.tgt").read_text(encoding="utf-8").splitlines()[:setup.lines]
    model = runs / "bf16" / "checkpoint_last.pt"
    models = [model, sorted((runs / "bf16").glob("checkpoint_[0-9]*.pt"))[0]]
    checks = []
    if "translate" in only:
        checks += guarded("translate", check_translate, setup, model, source, refs)
    if "decoding" in only:
        few = runs / "few.src"
        few.write_text("".join(source.read_text(encoding="utf-8").splitlines(True)[:8]),
                       encoding="utf-8")
        checks += guarded("decoding", check_decoding_modes, setup, models, few,
                          runs / "attn")
    return checks


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dry-run", action="store_true",
                        help="CPU, toy sizes: every step runs, CUDA-only figures are n/a")
    parser.add_argument("--out", type=Path, default=REPO / "bench" / "out" / "gpu_check")
    parser.add_argument("--updates", type=int, default=None,
                        help="training updates per run (default 600; dry run 16)")
    parser.add_argument("--lines", type=int, default=None,
                        help="test2016 lines to translate (default 1000; dry run 40)")
    parser.add_argument("--loss-tol", type=float, default=0.15,
                        help="mean |train loss difference| GPU vs CPU fp32, nats")
    parser.add_argument("--data", type=Path, default=None,
                        help="a prepared, BPE-encoded DATA dir (default: Multi30k prepared "
                        "into OUT/data)")
    parser.add_argument("--only", default=",".join(GROUPS),
                        help="comma-separated checks to run, of: " + ", ".join(GROUPS))
    opts = parser.parse_args()
    only = [name.strip() for name in opts.only.split(",") if name.strip()]
    unknown = sorted(set(only) - set(GROUPS))
    if unknown or not only:
        parser.error(f"--only: unknown {', '.join(unknown) or '(none given)'}; choose from "
                     + ", ".join(GROUPS))
    import torch

    dry = opts.dry_run or not torch.cuda.is_available()
    setup = Setup(dry=dry, device="cpu" if dry else "cuda", out=opts.out,
                  data=opts.data or opts.out / "data",
                  updates=opts.updates or (16 if dry else 600),
                  lines=opts.lines or (40 if dry else 1000),
                  loss_tol=opts.loss_tol if not dry else 1.0)
    runs = setup.out / "runs"
    if runs.exists():
        import shutil

        shutil.rmtree(runs)
    runs.mkdir(parents=True)
    if set(only) - {"big_memory", "shape_8gpu"}:  # the others read DATA
        start = time.perf_counter()
        prepare(setup)
        print(f"[{time.perf_counter() - start:6.1f} s] data ready: {setup.data}", flush=True)
    checks = []
    if "training" in only:
        checks += guarded("training", check_training, setup, runs)
    if "resume" in only:
        checks += guarded("resume", check_resume, setup, runs)
    if {"translate", "decoding"} & set(only):
        checks += guarded("translate", translation_checks, setup, runs, only)
    if "host_syncs" in only:
        checks += guarded("host_syncs", check_host_syncs, setup, runs)
    if "big_memory" in only:
        checks += guarded("big_memory", check_big_memory, setup)
    if "shape_8gpu" in only:
        checks += guarded("shape_8gpu", check_shape_8gpu, setup)
    if "torchrun_2proc" in only:
        checks += guarded("torchrun_2proc", check_torchrun, setup, runs)

    name = torch.cuda.get_device_name() if setup.device == "cuda" else "cpu (dry run)"
    width = max(len(c.name) for c in checks)
    print(f"gpu_check on {name}, torch {torch.__version__}, {setup.updates} updates, "
          f"{setup.lines} test lines")
    for c in checks:
        print(f"  {c.name:<{width}}  {c.status:<4}  {c.figure}" + (f"  [{c.detail}]"
                                                                  if c.detail else ""))
    failed = [c.name for c in checks if c.status == "FAIL"]
    from nmt.doctor import report as machine  # beside every figure
    print(json.dumps({"doctor": machine(measure=False),
                      "bench": "gpu_check", "device": name, "dry_run": setup.dry,
                      "torch": torch.__version__, "updates": setup.updates,
                      "lines": setup.lines, "failed": failed,
                      "checks": {c.name: {"status": c.status, "figure": c.figure,
                                          "detail": c.detail, **c.data} for c in checks}}))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
