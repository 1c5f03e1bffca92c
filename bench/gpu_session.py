"""The GPU check in one command: install onto the machine's own torch, then each step of
the GPU check (CUDA tests, correctness, speed, quality) with its own time cap, everything
written under --out as it goes.

On a machine with a GPU (its own Python and torch), from the checkout root:

    python3 bench/gpu_session.py --out OUT --work /tmp/gs                 # a, b
    python3 bench/gpu_session.py --out OUT --work /tmp/gs --only second   # c
    python3 bench/gpu_session.py --out OUT --work /tmp/gs --only third    # d, e
    python3 bench/gpu_session.py --out OUT --work /tmp/gs --only levers  # the levers
    python3 bench/gpu_session.py --dry-run            # CPU, toy sizes: what CI runs

Each of the three groups takes about 5-7 minutes on an H200 (the first about 7, the second
about 5), plus the install the first time.

What it needs besides the checkout: torch with CUDA, nmt's other dependencies but
sacremoses (typer, sentencepiece, sacrebleu, rich, numpy; pytest for the tests step), and
the shared data (Multi30k, newstest2014) in ../shared/data or where NMT_SHARED_DATA points.
Its install step installs
the checkout onto that torch without network (pip --no-index --no-deps -e .), taking
sacremoses and its dependencies from bench/gpu_offline/wheels; it is skipped where nmt and
sacremoses already import (after your own `pip install -e .` on a machine with network).
On a machine without network access, first run `make gpu-offline-files` where there is
network: it downloads those wheels (for Python 3.12; `GPU_PY=3.x` for another) and copies
the shared data into the git-ignored bench/gpu_offline/, where the session looks for both;
then copy the checkout, bench/gpu_offline/ included, to the GPU machine.

Steps (names for --only; `first` = tests,check, `second` = train, `third` = speed,quality;
or a single step by the name it has in steps.jsonl, e.g. check_other, train_big_8gpu):
  tests    a. `pytest -m gpu` (the CUDA tests)
  check    b. bench/gpu_check.py (training bf16/fp16 vs CPU fp32, resume after SIGKILL,
              translation at every precision, decoding modes, host-sync census, big memory,
              the 8-GPU shape, --gpus 2), with fewer updates and lines than its defaults,
              in two capped halves (check_train, check_other)
  train    c. bench/gpu_train_speed.py: base and big, the 1-GPU and 8-GPU shapes, reference
              and fused loss, eager and --compile, peak memory, MFU against the bf16 matmul
              peak it measures; a torch.profiler look (device busy fraction, kernels) and
              the whole update as one micro-batch (is the host the limit?)
  speed    d. bench/gpu_translate_speed.py: beam search on CUDA, bf16 and fp32
  quality  e. the Multi30k recipe for --quality-minutes on CUDA, averaged, test2016 BLEU
Each step's output goes to OUT/<step>.log (data and runs to --work: keep it out of OUT,
which then holds only the logs and the JSON lines), one JSON line per step to
OUT/steps.jsonl (rc, seconds, timed out), and the end prints where each minute went. A step
that hangs costs its cap, not the session; --budget-s (default 7 minutes) caps the whole
session, cutting the last steps' caps and skipping what no longer fits, so that a session
keeps to the time planned for it, and a second one after a fix re-runs only the steps it
names. Correctness first, then speed, then quality. The dry run reports GPU-only figures as
n/a (the benches' own dry modes).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shlex
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
# git-ignored: wheels/ and shared/ for a GPU machine without network (make gpu-offline-files)
OFFLINE = REPO / "bench" / "gpu_offline"
PY = sys.executable
# Three groups, each about 5-7 minutes on an H200 (measured 2026-11-27: tests 67 s,
# check 180 s + 75 s; the train group about 5 minutes): correctness, then training speed,
# then decoding speed and quality.
GROUPS = {"first": ["tests", "check"], "second": ["train"], "third": ["speed", "quality"]}
STEPS = ("install", "tests", "check", "train", "speed", "quality", "levers")  # --only names


@dataclass
class Step:
    """One capped command of the session."""

    name: str
    argv: list[str]
    cap_s: int
    env: dict[str, str] | None = None


def shared_data() -> Path:
    """Where the shared data is: NMT_SHARED_DATA, else the offline copy
    (bench/gpu_offline/shared), else ../shared/data."""
    if "NMT_SHARED_DATA" in os.environ:
        return Path(os.environ["NMT_SHARED_DATA"])
    if (OFFLINE / "shared" / "multi30k").is_dir():
        return OFFLINE / "shared"
    return REPO.parent / "shared" / "data"


def install_step() -> Step | None:
    """pip install of this checkout onto the running Python's torch, no network: the
    missing wheels from bench/gpu_offline/wheels. None when nmt (with nmt.cli) and
    sacremoses import."""
    if importlib.util.find_spec("nmt") and importlib.util.find_spec("sacremoses") \
            and importlib.util.find_spec("nmt.cli"):
        return None
    wheels = OFFLINE / "wheels"
    script = (f"{shlex.quote(PY)} -m pip install -q --no-index --find-links "
              f"{shlex.quote(str(wheels))} sacremoses && {shlex.quote(PY)} -m pip install -q "
              f"--no-index --no-deps --no-build-isolation -e {shlex.quote(str(REPO))}")
    return Step("install", ["bash", "-c", script], 120)


def steps(only: list[str], dry: bool, work: Path, quality_minutes: float) -> list[Step]:
    """The session's commands, in order, with their caps (seconds; dry run: CPU toy sizes);
    data, runs and checkpoints go under `work`."""
    data = work / "data"  # Multi30k prepared once by the check, reused by quality
    plan: list[Step] = []
    if "tests" in only:
        plan.append(Step("tests", [PY, "-m", "pytest", "-m", "gpu", "-q", "-p",
                                   "no:cacheprovider"], 120))
    if "check" in only:
        # Two capped halves: what needs the bf16 run (training, resume, translation), then
        # the rest, so a slow first half cannot take the second's rows with it.
        sizes = ["--dry-run"] if dry else ["--updates", "200", "--lines", "300"]
        # Dry caps are wider: on an AVX2-only CPU bf16/fp16 are emulated (check_train took
        # 167 s alone on a 2.45 GHz Zen 3, over 270 s beside a second test worker).
        for half, groups, cap, dry_cap in (
                ("check_train", "training,resume,translate,decoding", 270, 600),
                ("check_other", "host_syncs,big_memory,shape_8gpu,torchrun_2proc", 120, 240)):
            plan.append(Step(half, [PY, "bench/gpu_check.py", *sizes, "--only", groups,
                                    "--out", str(work / half), "--data", str(data)],
                             dry_cap if dry else cap))
    if "train" in only:
        plan.append(Step("matmul_peak", [PY, "-c", PEAK_CODE, "256" if dry else "8192"], 60))
        # The dry run's speed steps train in fp32: they check that each command runs, and
        # bf16 is emulated on an AVX2-only CPU (24 s against 10 s for a `big` step on a Zen
        # 3); the benches' bf16 smoke runs are tests/test_gpu_speed_benches.py's.
        common = ["--smoke", "--precision", "fp32"] if dry else ["--steps", "8", "--warmup", "3"]
        plan.append(Step("train_base_1gpu_profile", [
            PY, "bench/gpu_train_speed.py", "--arch", "base", "--profile", *common],
            75 if not dry else 120))  # where the step time goes: busy fraction, kernels
        # One micro-batch of the whole 25,000-token update instead of 3 x 8,805: if the
        # step time barely grows, the host (kernel launches), not the GPU, sets the pace.
        # Its peak memory for base and big says whether the WMT recipe's max_tokens (12,500)
        # could rise on large GPUs.
        for arch in ("base", "big"):
            plan.append(Step(f"train_{arch}_1gpu_one_micro", [
                PY, "bench/gpu_train_speed.py", "--arch", arch, "--update-freq", "1",
                "--max-tokens", "1024" if dry else "27000", "--loss", "fused",
                *(common if dry else ["--steps", "6", "--warmup", "2"])],
                60 if not dry else 120))
        for arch in ("base", "big"):
            for gpus in ("1", "8"):
                plan.append(Step(f"train_{arch}_{gpus}gpu", [
                    PY, "bench/gpu_train_speed.py", "--arch", arch, "--gpus", gpus,
                    "--loss", "both", *common], 60 if not dry else 120))
        plan.append(Step("train_base_1gpu_compile", [
            PY, "bench/gpu_train_speed.py", "--arch", "base", "--compile", *common],
            90 if not dry else 480))  # inductor's C++ build: 100-290 s on 2 cores
    if "levers" in only:
        plan += lever_steps(dry)
    if "speed" in only:
        speed = ["--smoke"] if dry else ["--random-arch", "base", "--precisions", "bf16,fp32"]
        plan.append(Step("speed", [PY, "bench/gpu_translate_speed.py", *speed], 150))
    if "quality" in only:
        minutes = 0.2 if dry else quality_minutes
        device = "cpu" if dry else "cuda"
        run = work / "quality"
        nmt = [PY, "-m", "nmt.cli.main"]
        # The dry run's budget is in updates: in 0.2 minutes a slow CPU (a 2.45 GHz Zen 3)
        # made 10 updates and 4 checkpoints, too few for `--last 5`.
        budget = (["--max-updates", "12", "--save-interval-updates", "2"] if dry else
                  ["--max-minutes", str(minutes), "--save-interval-minutes", str(minutes / 6)])
        script = " && ".join(shlex.join(cmd) for cmd in [
            [*nmt, "train", str(data), "-o", str(run), "--device", device, *budget],
            [*nmt, "average", str(run), "--last", "5", "-o", str(run / "average.pt")],
            [*nmt, "translate", "-m", str(run / "average.pt"), "--device", device,
             "-i", str(data / "test.src"), "-o", str(run / "test.hyp")],
            [*nmt, "score", "--ref", str(data / "test.tgt"), "-i", str(run / "test.hyp"),
             "--metrics", "bleu,chrf"]])
        if not (data / "bin").is_dir():  # the check step prepares it; alone, prepare here
            prep = " && ".join(shlex.join(cmd) for cmd in [
                [*nmt, "prep", "multi30k-en-de", "-o", str(data), "--mirror",
                 str(shared_data() / "multi30k")], [*nmt, "bpe", str(data)]])
            script = f"{prep} && {script}"
        plan.append(Step("quality", ["bash", "-c", script], int(minutes * 60) + 120))
    return plan


def lever_steps(dry: bool) -> list[Step]:
    """Issue 71's levers on base (the 1-GPU shape, reference loss: the H200 figures' run),
    each on top of the one before, then big: autocast with fp32 weights (3 x 8,805), a bf16
    copy with fp32 master weights, the micro-batch planned from the GPU's memory (the
    update in one), compiled per length bucket, CUDA graphs; the compiled steps time the two
    most common buckets (each bucket is a compile); first, which SDPA kernel runs the
    padding-masked and the causal attention, and that an all-PAD row stays finite. About 6
    minutes on an H200."""
    common = ["--smoke"] if dry else ["--steps", "6", "--warmup", "2"]
    half = ["--half-weights"]
    planned = [*half, "--max-tokens", "1024" if dry else "0"]
    graphs = ["--compile", "--max-buckets", "2"]
    runs = [("levers_peak", None, 60), ("levers_sdpa", None, 45),
            ("levers_base_eager", [], 45), ("levers_base_half", half, 45),
            ("levers_base_planned", planned, 60),
            ("levers_base_graphs", [*planned, *graphs, "--cuda-graphs"], 120),
            ("levers_big_planned", ["--arch", "big", *planned, "--loss", "fused"], 60),
            ("levers_base_compile", [*planned, *graphs], 120),
            ("levers_big_graphs", ["--arch", "big", *planned, "--loss", "fused", *graphs,
                                   "--cuda-graphs"], 150),
            ("levers_base_8gpu_graphs", ["--gpus", "8", *planned, *graphs, "--cuda-graphs"],
             120)]
    plan = []
    for name, flags, cap in runs:
        if flags is None and name == "levers_sdpa":
            plan.append(Step(name, [PY, "-c", SDPA_CODE], cap))
            continue
        if flags is None:
            plan.append(Step(name, [PY, "-c", PEAK_CODE, "256" if dry else "8192"], cap))
            continue
        plan.append(Step(name, [PY, "bench/gpu_train_speed.py", *common, *flags],
                         max(cap, 300) if dry else cap))
    return plan


# Times an N^3 bf16 matmul on the device (CUDA, else CPU) after a warm-up: the measured
# dense bf16 peak that the training MFU is reported against. Prints one JSON line.
PEAK_CODE = """
import json, sys, time, torch
n = int(sys.argv[1])
dev = "cuda" if torch.cuda.is_available() else "cpu"
a = torch.randn(n, n, device=dev, dtype=torch.bfloat16)
b = torch.randn(n, n, device=dev, dtype=torch.bfloat16)
sync = torch.cuda.synchronize if dev == "cuda" else (lambda: None)
for _ in range(3):
    a @ b
sync()
reps = 20 if dev == "cuda" else 2
start = time.perf_counter()
for _ in range(reps):
    a @ b
sync()
seconds = (time.perf_counter() - start) / reps
name = torch.cuda.get_device_name() if dev == "cuda" else "cpu"
print(json.dumps({"matmul": f"{n}^3 bf16", "device": name, "torch": torch.__version__,
                  "cuda": torch.version.cuda, "tflops": round(2 * n ** 3 / seconds / 1e12, 1)}))
"""


# Which SDPA kernel runs training's attention on this device (bf16, base's heads, WMT-like
# length): the encoder's and cross-attention's boolean padding mask (the model's own,
# key_padding_mask) and the decoder's is_causal, forward and backward, named from the
# profiler's kernels; and whether an all-PAD row (a padded batch's filler) stays finite.
SDPA_CODE = """
import json, torch
import torch.nn.functional as F
from nmt.model.attention import key_padding_mask
dev = "cuda" if torch.cuda.is_available() else "cpu"
dt = torch.bfloat16
b, h, n, d = 64, 8, 40, 64
pad = torch.zeros(b, n, dtype=torch.bool, device=dev)
pad[1, 30:] = True
pad[2, :] = True  # an all-PAD filler row
mask = key_padding_mask(pad)
q, k, v = (torch.randn(b, h, n, d, device=dev, dtype=dt, requires_grad=True)
           for _ in range(3))
report = {"device": torch.cuda.get_device_name() if dev == "cuda" else "cpu",
          "torch": torch.__version__, "cuda": torch.version.cuda}
for name, kw in (("padding_mask", {"attn_mask": mask}), ("causal", {"is_causal": True})):
    with torch.profiler.profile() as prof:
        out = F.scaled_dot_product_attention(q, k, v, **kw)  # the presets: no attention dropout
        out.float().sum().backward()
    names = sorted({e.name for e in prof.events()
                    if any(t in e.name.lower() for t in ("flash", "efficient", "fmha",
                                                          "cudnn", "sdp", "attention"))})
    report[name] = {"kernels": names[:8], "finite": bool(torch.isfinite(out).all()),
                    "grads_finite": all(bool(torch.isfinite(t.grad).all())
                                        for t in (q, k, v))}
    for t in (q, k, v):
        t.grad = None
print(json.dumps(report))
"""


def measured_peak(out: Path) -> float | None:
    """The TFLOP/s the matmul_peak step printed (its log's last JSON line), else None."""
    for name in ("matmul_peak", "levers_peak"):
        log = out / f"{name}.log"
        for line in reversed(log.read_text(encoding="utf-8").splitlines() if log.is_file()
                             else []):
            if line.startswith("{"):
                return float(json.loads(line)["tflops"]) or None
    return None


def run_step(step: Step, out: Path, record: Path) -> dict[str, object]:
    """Run one capped step, its output to OUT/<name>.log; append and return its record."""
    log = out / f"{step.name}.log"
    start = time.perf_counter()
    timed_out = False
    with log.open("w", encoding="utf-8") as sink:
        sink.write(f"$ {shlex.join(step.argv)}\n")
        sink.flush()
        proc = subprocess.Popen(step.argv, cwd=REPO, stdout=sink, stderr=subprocess.STDOUT,
                                env={**os.environ, "PYTHONUNBUFFERED": "1",
                                     **(step.env or {})},
                                start_new_session=True)
        try:
            rc = proc.wait(timeout=step.cap_s)
        except subprocess.TimeoutExpired:
            timed_out = True
            os.killpg(proc.pid, 9)
            rc = proc.wait()
    result = {"step": step.name, "rc": rc, "seconds": round(time.perf_counter() - start, 1),
              "cap_s": step.cap_s, "timed_out": timed_out, "log": str(log)}
    with record.open("a", encoding="utf-8") as sink:
        sink.write(json.dumps(result) + "\n")
    print(json.dumps(result), flush=True)
    return result


def main() -> int:
    # The docstring's first paragraph says what runs, its "What it needs" one what a machine
    # without network needs first (make gpu-offline-files).
    paragraphs = __doc__.split("\n\n")
    parser = argparse.ArgumentParser(
        description=paragraphs[0],
        epilog=next(p for p in paragraphs if p.startswith("What it needs")))
    parser.add_argument("--dry-run", action="store_true",
                        help="CPU, toy sizes (GPU-only figures n/a): what CI runs")
    parser.add_argument("--only", default="first",
                        help="comma-separated steps or groups: " + ", ".join(STEPS[1:])
                        + "; first = tests,check; second = train; third = speed,quality; "
                        "levers = issue 71's training levers (about 6 minutes); or one "
                        "step of a group by its name (check_other, train_big_8gpu, ...)")
    parser.add_argument("--out", type=Path, default=REPO / "bench" / "out" / "gpu_session")
    parser.add_argument("--work", type=Path, default=None,
                        help="data, runs and checkpoints (default OUT/work); put it "
                        "outside --out to keep OUT to the logs and the JSON lines")
    parser.add_argument("--quality-minutes", type=float, default=3.0)
    parser.add_argument("--budget-s", type=float, default=420.0,
                        help="the whole session's command time: each step's cap is cut to "
                        "what is left, and a step with under 15 s left is skipped (default "
                        "7 min)")
    opts = parser.parse_args()
    only: list[str] = []
    names = [n.strip() for n in opts.only.split(",") if n.strip()]
    for name in names:
        only += GROUPS.get(name, [name])
    # A step's own name (train_big_8gpu, check_other, ...) picks that step of its group,
    # in the plan's order: a second session re-runs only what failed or did not fit.
    grouped = [(group, step) for group in STEPS[1:]
               for step in steps([group], opts.dry_run, opts.work or opts.out / "work",
                                 opts.quality_minutes)]
    picked = {n for n in only if n not in STEPS}
    unknown = sorted(picked - {step.name for _, step in grouped})
    if unknown or not only:
        parser.error(f"--only: unknown {', '.join(unknown) or '(none)'}")
    plan = [step for group, step in grouped if group in only or step.name in picked]
    opts.out.mkdir(parents=True, exist_ok=True)
    record = opts.out / "steps.jsonl"
    record.unlink(missing_ok=True)
    os.environ.setdefault("NMT_SHARED_DATA", str(shared_data()))
    session_start = time.perf_counter()
    results = []
    install = install_step()
    if install is not None:
        results.append(run_step(install, opts.out, record))
        if results[-1]["rc"] != 0:
            print("gpu_session: install failed; see its log", file=sys.stderr)
            return 1
    for step in plan:
        left = opts.budget_s - (time.perf_counter() - session_start)
        if left < 15:
            skipped = {"step": step.name, "rc": None, "skipped": "out of --budget-s"}
            with record.open("a", encoding="utf-8") as sink:
                sink.write(json.dumps(skipped) + "\n")
            print(json.dumps(skipped), flush=True)
            results.append({**skipped, "seconds": 0.0, "timed_out": False})
            continue
        step.cap_s = int(min(step.cap_s, left))
        peak = measured_peak(opts.out)
        if step.name.startswith(("train_", "levers_b")) and peak and not opts.dry_run:
            step.argv += ["--peak-tflops", str(peak)]  # MFU against the measured peak
        results.append(run_step(step, opts.out, record))
    total = time.perf_counter() - session_start
    print("\nwhere the time went:")
    for r in results:
        mark = (" skipped (budget)" if r["rc"] is None else " TIMED OUT" if r["timed_out"]
                else "" if r["rc"] == 0 else f" rc {r['rc']}")
        print(f"  {r['step']:<26} {r['seconds']:7.1f} s{mark}")
    print(f"  {'total':<26} {total:7.1f} s")
    failed = [r["step"] for r in results if r["rc"] not in (0, None)]
    from nmt.doctor import report as machine  # beside every figure
    print(json.dumps({"doctor": machine(measure=False),
                      "bench": "gpu_session", "dry_run": opts.dry_run, "total_s":
                      round(total, 1), "failed": failed, "steps": results}))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
