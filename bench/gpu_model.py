"""A model of one GPU training update's time: predicted MFU of `base` and `big` under the
speed levers, from operation counts made on a CPU.

Why: a GPU visit is short and rare, and the one measured so far (NVIDIA H200, 2026-11-27,
docs/performance.md) found MFU 8.6 % where the aim is 40 %, with the two batch shapes
pointing at a fixed host cost per dispatched op. Which lever to spend the next visit on
(bf16 weights, a padded vocabulary, `torch.compile`, CUDA graphs) can be ranked beforehand
from what a CPU can count: `bench/gpu_train_speed.py --count-ops --json-out COUNTS.json`
writes, per arch, lever and shape, the ops the host dispatches, the kernels the GPU runs,
the FLOPs and the bytes of one update. This script turns those counts into times with a
few stated constants and one fitted parameter, and says for each lever whether the host or
the device would then limit the update.

The model (pure functions: `predict`, `fit_host_cost`; every constant is in `Consts` and
`DEVICES`, printed with the figures and carried in the JSON line):

    device = (model + attention FLOPs) / (matmul efficiency x measured bf16 peak)
             + bytes / (bandwidth efficiency x HBM bandwidth)
             + kernels x per-kernel gap
    host   = host ops x host cost per op of the record's class
             (eager: c, the fitted parameter; compiled: 0.3 c; graphed: 1.0 c per counted op)
    update = max(host, device) + serial
    serial = fused Adam's traffic (28 bytes per parameter) at the bandwidth + one host sync

Host and device overlap because launches are asynchronous, so the longer of the two sets
the pace; the serial part is the update's tail that overlaps nothing (the optimizer step
after the last gradient, the sync at the update's end). Assumptions: matmul efficiency 0.7
of the measured peak at these shapes (attention FLOPs included); bandwidth efficiency 0.8
for the non-matmul kernels' traffic; a per-kernel gap of 2.5 us of device time (launch to
launch, also under CUDA graphs); an op of compiled code (a call of an inductor kernel's
launcher or an extern op) costs the host 0.3 of an eager op, whose cost goes through
PyTorch's Python, autograd, autocast and dispatcher; under CUDA graphs the count is already
replays plus the ops outside the graph, each about an eager op's cost (a replay's launch
is some microseconds), so the near-zero per-op cost inside a graph is in the count, not in
the fraction; one host CPU as fast as the calibration's; no communication (the 8-GPU
shape is one GPU's share, its all-reduce not modelled: whatever of it the measured 40.0 ms
holds, the fit absorbs into c); memory traffic and FLOPs do not overlap each other.

Calibration: the only GPU figures measured, NVIDIA H200 (driver 580.159.04, torch
2.11.0+cu130, CUDA 13.0), Transformer base, vocabulary 37,000, bf16 autocast, eager,
reference loss: the 1-GPU shape (3 x 8,805 padded tokens per update) 140.2 ms per update,
350,451 tokens/s, MFU 8.6 %; the 8-GPU shape (1 x 3,308) 40.0 ms (29.7 model TFLOP/s).
c is fitted by least squares of the relative errors on these two times (each figure
weighs the same), with the counts of the input's base eager records at the two shapes and
the H200's constants whichever `--device` is predicted; the error on each is printed.
`--host-cost-us X` takes c as given (no fit; the records are then not required). MFU is
model FLOPs (6 per parameter per token it multiplies, no attention) per second over the
MEASURED dense bf16 peak (790 TFLOP/s on the H200: 785.5 and 792.1 measured, 8192^3), and
also over the datasheet's 989. The H100 SXM column has the datasheet's 989 TFLOP/s and
3.35 TB/s; its measured peak is not measured but assumed the H200's fraction of the
datasheet (790 / 989). No `nmt doctor` facts in the JSON line: the figures are a model's,
not this machine's.

    .venv/bin/python bench/gpu_model.py COUNTS.json [--device h200|h100] [--host-cost-us X]

Prints the assumptions, the calibration, one table per arch and shape (lever, host ms,
device ms, ms per update, tokens/s, MFU, what limits), then one JSON line (the last line).
A counts file without the base eager records at both shapes is refused (exit 2, one line).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, replace
from itertools import pairwise
from pathlib import Path
from typing import Any, NoReturn

LEVERS = ("as-measured", "eager", "bf16-weights", "padded-vocab", "rows-linear", "one-micro",
          "compile", "cuda-graphs")  # bench/_count_ops.py's order: each on top of the one before
HOST_COST_CLASSES = ("eager", "compiled", "graphed")
ARCHS = ("base", "big")
SHAPES = ("1gpu", "8gpu")
# Parameters at vocabulary 37,000 with shared embeddings (nmt's Transformer, counted):
# what fused Adam reads and writes in the serial part. A record's own "params" overrides.
PARAMS: dict[str, int] = {"base": 63_082_496, "big": 214_245_376}


@dataclass(frozen=True)
class Device:
    """A GPU's dense bf16 peaks (TFLOP/s) and HBM bandwidth (TB/s)."""

    name: str
    peak_measured_tflops: float
    peak_datasheet_tflops: float
    hbm_tb_per_s: float
    note: str


H200_MEASURED_FRACTION = 790.0 / 989.0
DEVICES: dict[str, Device] = {
    "h200": Device("NVIDIA H200", 790.0, 989.0, 4.8,
                   "measured peak 785.5 and 792.1 TFLOP/s (8192^3 bf16 matmul, 2026-11-27): "
                   "790 used; HBM3e 4.8 TB/s (datasheet)"),
    "h100": Device("NVIDIA H100 SXM", round(989.0 * H200_MEASURED_FRACTION, 1), 989.0, 3.35,
                   "measured peak NOT measured: assumed the H200's fraction of the datasheet "
                   "(790 / 989); HBM3 3.35 TB/s (datasheet)"),
}


@dataclass(frozen=True)
class Consts:
    """The model's constants; `host_cost_eager_us` is the one fitted."""

    device: Device
    host_cost_eager_us: float = 10.0
    matmul_efficiency: float = 0.7  # of the measured peak, at these shapes
    bandwidth_efficiency: float = 0.8  # of HBM bandwidth, non-matmul kernels
    kernel_gap_us: float = 2.5  # device time per kernel beyond its work
    compiled_host_fraction: float = 0.3  # an inductor kernel launcher's call vs an eager op
    graphed_host_fraction: float = 1.0  # per counted op (a replay or an op outside a graph)
    adam_bytes_per_param: float = 28.0  # fp32 param, grad, m, v read; param, m, v written
    sync_us: float = 50.0  # the update's end: the host waits for the device

    def host_cost_us(self, host_cost_class: str) -> float:
        """Host microseconds per counted op of `host_cost_class`."""
        fraction = {"eager": 1.0, "compiled": self.compiled_host_fraction,
                    "graphed": self.graphed_host_fraction}[host_cost_class]
        return self.host_cost_eager_us * fraction


@dataclass(frozen=True)
class Record:
    """One record of the counts file: one arch, lever and shape's update, counted."""

    arch: str
    lever: str
    shape: str
    micro_batches: int
    micro_tokens: int
    tokens_per_update: float
    host_ops_per_update: float
    kernels_per_update: float
    model_flops_per_update: float
    attention_flops_per_update: float
    bytes_per_update: float
    host_cost_class: str
    params: int | None = None  # optional; else PARAMS[arch]

    @classmethod
    def from_json(cls, obj: Mapping[str, Any]) -> Record:
        """A record from its JSON object; ValueError naming what is missing or wrong."""
        if not isinstance(obj, Mapping):
            raise ValueError("a record is not a JSON object")
        values: dict[str, Any] = {}
        for name in ("arch", "lever", "shape", "host_cost_class"):
            if not isinstance(obj.get(name), str):
                raise ValueError(f"a record lacks the string {name!r}")
            values[name] = obj[name]
        for name in ("micro_batches", "micro_tokens", "tokens_per_update",
                     "host_ops_per_update", "kernels_per_update", "model_flops_per_update",
                     "attention_flops_per_update", "bytes_per_update"):
            value = obj.get(name)
            if (not isinstance(value, (int, float)) or isinstance(value, bool)
                    or not math.isfinite(value) or value < 0):
                raise ValueError(f"record {values['arch']}/{values['lever']}/"
                                 f"{values['shape']}: {name!r} is not a number >= 0")
            values[name] = value
        if values["host_cost_class"] not in HOST_COST_CLASSES:
            raise ValueError(f"record {values['arch']}/{values['lever']}/{values['shape']}: "
                             f"host_cost_class {values['host_cost_class']!r} is not one of "
                             f"{', '.join(HOST_COST_CLASSES)}")
        params = obj.get("params")
        if params is None and values["arch"] not in PARAMS:
            raise ValueError(f"record {values['arch']}/{values['lever']}/{values['shape']}: "
                             "unknown arch and no 'params'")
        return cls(**values, params=None if params is None else int(params))

    @property
    def key(self) -> tuple[str, str, str]:
        """(arch, shape, lever)."""
        return (self.arch, self.shape, self.lever)


@dataclass(frozen=True)
class Prediction:
    """One update's predicted times (ms) and rates."""

    arch: str
    shape: str
    lever: str
    host_ms: float
    device_ms: float
    matmul_ms: float
    memory_ms: float
    kernel_gap_ms: float
    serial_ms: float
    ms_per_update: float
    tokens_per_s: float
    model_tflops: float
    mfu: float  # of the measured peak
    mfu_datasheet: float
    limit: str  # "host" or "device"


@dataclass(frozen=True)
class Measured:
    """A measured figure the host cost is fitted to."""

    shape: str
    ms_per_update: float
    micro_batches: int
    micro_tokens: int
    note: str


CALIBRATION: tuple[Measured, ...] = (
    Measured("1gpu", 140.2, 3, 8805, "350,451 tokens/s, MFU 8.6 %"),
    Measured("8gpu", 40.0, 1, 3308, "29.7 model TFLOP/s"),
)
CALIBRATION_SOURCE = ("NVIDIA H200, driver 580.159.04, torch 2.11.0+cu130, CUDA 13.0, "
                      "2026-11-27; base, vocabulary 37,000, bf16 autocast, eager, "
                      "reference loss")


def predict(record: Record, consts: Consts) -> Prediction:
    """The update time of `record` under `consts`: max(host, device) + serial."""
    dev = consts.device
    matmul_s = ((record.model_flops_per_update + record.attention_flops_per_update)
                / (consts.matmul_efficiency * dev.peak_measured_tflops * 1e12))
    bandwidth = consts.bandwidth_efficiency * dev.hbm_tb_per_s * 1e12
    memory_s = record.bytes_per_update / bandwidth
    gap_s = record.kernels_per_update * consts.kernel_gap_us * 1e-6
    device_s = matmul_s + memory_s + gap_s
    host_s = record.host_ops_per_update * consts.host_cost_us(record.host_cost_class) * 1e-6
    params = record.params if record.params is not None else PARAMS[record.arch]
    serial_s = params * consts.adam_bytes_per_param / bandwidth + consts.sync_us * 1e-6
    total_s = max(host_s, device_s) + serial_s
    model_flops_per_s = record.model_flops_per_update / total_s
    return Prediction(
        arch=record.arch, shape=record.shape, lever=record.lever,
        host_ms=host_s * 1e3, device_ms=device_s * 1e3, matmul_ms=matmul_s * 1e3,
        memory_ms=memory_s * 1e3, kernel_gap_ms=gap_s * 1e3, serial_ms=serial_s * 1e3,
        ms_per_update=total_s * 1e3, tokens_per_s=record.tokens_per_update / total_s,
        model_tflops=model_flops_per_s / 1e12,
        mfu=model_flops_per_s / (dev.peak_measured_tflops * 1e12),
        mfu_datasheet=model_flops_per_s / (dev.peak_datasheet_tflops * 1e12),
        limit="host" if host_s > device_s else "device")


def fit_host_cost(records: Sequence[Record], measured_ms: Sequence[float],
                  consts: Consts | None = None) -> float:
    """The eager host cost per op (us) that best fits `measured_ms` (one time per record).

    Least squares of the relative errors, exactly: each record's predicted time is
    max(a c, d) + s in c, so between the breakpoints d / a the objective is a quadratic in
    the records the host limits there; its minimum in each interval is a candidate. Where
    the device alone explains the figures (no record host-bound), the largest c that keeps
    them so is returned. `consts` defaults to the H200's (where the figures were measured).
    """
    if not records or len(records) != len(measured_ms):
        raise ValueError("fit_host_cost needs one measured time per record, at least one")
    if any(m <= 0 for m in measured_ms):
        raise ValueError("measured times must be > 0")
    unit = replace(consts or Consts(DEVICES["h200"]), host_cost_eager_us=1.0)
    probes = [predict(r, unit) for r in records]
    a = [p.host_ms for p in probes]  # ms per us of eager host cost
    d = [p.device_ms for p in probes]
    s = [p.serial_ms for p in probes]
    m = list(measured_ms)
    if not any(ai > 0 for ai in a):
        raise ValueError("no host ops to fit a host cost to")

    def loss(c: float) -> float:
        return sum(((max(ai * c, di) + si - mi) / mi) ** 2
                   for ai, di, si, mi in zip(a, d, s, m, strict=True))

    breaks = sorted({di / ai for ai, di in zip(a, d, strict=True) if ai > 0})
    edges = [0.0, *breaks, math.inf]
    candidates: list[float] = []
    for lo, hi in pairwise(edges):
        bound = [i for i in range(len(a)) if a[i] > 0 and d[i] / a[i] <= lo]
        if not bound:  # flat: every record device-bound here
            candidates.append(hi if math.isfinite(hi) else lo)
            continue
        num = sum(a[i] * (m[i] - s[i]) / m[i] ** 2 for i in bound)
        den = sum(a[i] ** 2 / m[i] ** 2 for i in bound)
        candidates.append(min(max(num / den, lo), hi))
    return min(candidates, key=loss)


def assumptions(consts: Consts, fitted: bool) -> list[str]:
    """The model's assumptions, in words, as printed and carried in the JSON line."""
    dev = consts.device
    return [
        f"device {dev.name}: dense bf16 peak {dev.peak_measured_tflops:g} TFLOP/s measured "
        f"(MFU is against it), {dev.peak_datasheet_tflops:g} datasheet, HBM "
        f"{dev.hbm_tb_per_s:g} TB/s; {dev.note}",
        "device = FLOPs / (matmul eff x measured peak) + bytes / (bandwidth eff x HBM) "
        "+ kernels x gap; host = host ops x cost per op of the class; "
        "update = max(host, device) + serial (launches are asynchronous: they overlap)",
        f"matmul efficiency {consts.matmul_efficiency:g} of the measured peak (model and "
        "attention FLOPs)",
        f"bandwidth efficiency {consts.bandwidth_efficiency:g} of HBM for the non-matmul "
        "kernels' bytes; FLOPs and traffic do not overlap",
        f"per-kernel gap {consts.kernel_gap_us:g} us of device time (also under CUDA graphs)",
        f"host cost per eager op {consts.host_cost_eager_us:.2f} us "
        + ("(fitted to the two H200 figures)" if fitted else "(given: --host-cost-us)"),
        f"compiled: {consts.compiled_host_fraction:g} x the eager cost per counted op (an "
        "inductor kernel launcher's call or an extern op)",
        f"graphed: {consts.graphed_host_fraction:g} x the eager cost per counted op (a replay "
        "or an op outside the graph; ops inside a graph cost the host nothing)",
        f"serial: fused Adam, {consts.adam_bytes_per_param:g} bytes per parameter at the "
        f"bandwidth above, + {consts.sync_us:g} us host sync per update",
        "one host CPU as fast as the calibration's; communication (8-GPU all-reduce) not "
        "modelled",
    ]


def _order(value: str, known: Sequence[str]) -> tuple[int, str]:
    return (known.index(value) if value in known else len(known), value)


def _fail(message: str) -> NoReturn:
    print(f"gpu_model: error: {message}", file=sys.stderr)
    raise SystemExit(2)


def load_records(path: Path) -> list[Record]:
    """The counts file's records; ValueError (one line) if it cannot be read as one."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError) as err:
        raise ValueError(f"cannot read {path}: {err}") from None
    except json.JSONDecodeError as err:
        raise ValueError(f"{path} is not JSON: {err}") from None
    if not isinstance(data, Mapping) or not isinstance(data.get("records"), list):
        raise ValueError(f"{path}: no 'records' list")
    records = [Record.from_json(obj) for obj in data["records"]]
    seen: set[tuple[str, str, str]] = set()
    for record in records:
        if record.key in seen:
            raise ValueError(f"{path}: two records for {'/'.join(record.key)}")
        seen.add(record.key)
    return records


def calibrate(records: Sequence[Record], host_cost_us: float | None
              ) -> tuple[float, list[dict[str, Any]]]:
    """(eager host cost per op in us, the calibration rows): fitted to `CALIBRATION` unless
    `host_cost_us` is given. ValueError if fitting and the base eager records are missing."""
    by_key = {r.key: r for r in records}
    # The code the H200 ran, where the counts carry it ("as-measured"), else today's eager.
    pairs = [(by_key.get(("base", m.shape, "as-measured"), by_key.get(("base", m.shape,
                                                                          "eager"))), m)
             for m in CALIBRATION]
    if host_cost_us is None:
        missing = [m.shape for r, m in pairs if r is None]
        if missing:
            raise ValueError("the counts lack the base eager record at "
                             f"{' and '.join(missing)} (needed to fit the host cost; "
                             "or pass --host-cost-us)")
        host_cost_us = fit_host_cost([r for r, _ in pairs if r is not None],
                                     [m.ms_per_update for _, m in pairs])
    h200 = Consts(DEVICES["h200"], host_cost_eager_us=host_cost_us)
    rows = []
    for record, measured in pairs:
        if record is None:
            continue
        pred = predict(record, h200)
        rows.append({
            "shape": measured.shape, "measured_ms": measured.ms_per_update,
            "predicted_ms": round(pred.ms_per_update, 3),
            "error_pct": round(100 * (pred.ms_per_update / measured.ms_per_update - 1), 2),
            "limit": pred.limit, "measured_note": measured.note,
            "predicted_tokens_per_s": round(pred.tokens_per_s),
            "predicted_model_tflops": round(pred.model_tflops, 2),
            "predicted_mfu": round(pred.mfu, 4),
            "shape_matches": (record.micro_batches == measured.micro_batches
                              and record.micro_tokens == measured.micro_tokens),
            "counted_shape": f"{record.micro_batches} x {record.micro_tokens}",
            "measured_shape": f"{measured.micro_batches} x {measured.micro_tokens}"})
    return host_cost_us, rows


def _table(records: Sequence[Record], preds: Sequence[Prediction]) -> list[str]:
    first = records[0]
    lines = [f"{first.arch}, {first.shape}: {first.micro_batches} x {first.micro_tokens:,} "
             f"padded tokens per micro-batch, {first.tokens_per_update:,.0f} tokens per update",
             f"  {'lever':<13} {'host ms':>8} {'device ms':>9} {'ms/update':>9} "
             f"{'tokens/s':>10} {'MFU':>6} {'MFU dsh':>7}  limit"]
    for pred in preds:
        lines.append(f"  {pred.lever:<13} {pred.host_ms:>8.1f} {pred.device_ms:>9.1f} "
                     f"{pred.ms_per_update:>9.1f} {pred.tokens_per_s:>10,.0f} "
                     f"{100 * pred.mfu:>5.1f}% {100 * pred.mfu_datasheet:>6.1f}%  "
                     f"{pred.limit}")
    return lines


def main(argv: Sequence[str] | None = None) -> int:
    """Print the assumptions, calibration and per-arch tables, then the JSON line."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("counts", type=Path,
                        help="JSON of bench/gpu_train_speed.py --count-ops --json-out")
    parser.add_argument("--device", choices=sorted(DEVICES), default="h200",
                        help="the GPU predicted (the fit is always on the H200's figures)")
    parser.add_argument("--host-cost-us", type=float, default=None,
                        help="host cost per eager op in us: skips the fit")
    opt = parser.parse_args(argv)
    if opt.host_cost_us is not None and not (math.isfinite(opt.host_cost_us)
                                             and opt.host_cost_us >= 0):
        _fail("--host-cost-us must be a number >= 0")
    try:
        records = load_records(opt.counts)
        host_cost_us, calibration = calibrate(records, opt.host_cost_us)
    except ValueError as err:
        _fail(str(err))
    fitted = opt.host_cost_us is None
    consts = Consts(DEVICES[opt.device], host_cost_eager_us=host_cost_us)
    notes = assumptions(consts, fitted)

    print(f"GPU update model: {consts.device.name}, counts {opt.counts}")
    print("assumptions:")
    for note in notes:
        print(f"  - {note}")
    print(f"calibration ({CALIBRATION_SOURCE}):")
    for row in calibration:
        warn = "" if row["shape_matches"] else (
            f"  [counted {row['counted_shape']}, measured {row['measured_shape']}]")
        print(f"  base eager {row['shape']}: predicted {row['predicted_ms']:.1f} ms, measured "
              f"{row['measured_ms']:.1f} ms ({row['error_pct']:+.1f} %; {row['limit']}-"
              f"limited; measured {row['measured_note']}, predicted "
              f"{row['predicted_tokens_per_s']:,} tokens/s, "
              f"{row['predicted_model_tflops']:.1f} model TFLOP/s){warn}")
    if not calibration:
        print("  (no base eager records: no calibration error)")

    ordered = sorted(records, key=lambda r: (_order(r.arch, ARCHS), _order(r.shape, SHAPES),
                                             _order(r.lever, LEVERS)))
    predictions = [predict(r, consts) for r in ordered]
    groups: dict[tuple[str, str], list[int]] = {}
    for i, record in enumerate(ordered):
        groups.setdefault((record.arch, record.shape), []).append(i)
    for indices in groups.values():
        print()
        for line in _table([ordered[i] for i in indices], [predictions[i] for i in indices]):
            print(line)
    print("(MFU: of the measured peak; MFU dsh: of the datasheet's; tokens/s: this GPU)")

    constants = {k: v for k, v in asdict(consts).items() if k != "device"}
    result = {
        "bench": "gpu_model", "device": opt.device, "device_name": consts.device.name,
        "counts": str(opt.counts),
        "host_cost_us": round(host_cost_us, 4), "host_cost_fitted": fitted,
        "calibration": calibration,
        "predictions": [{k: (round(v, 6) if isinstance(v, float) else v)
                         for k, v in asdict(p).items()} for p in predictions],
        "constants": constants, "device_facts": asdict(consts.device),
        "assumptions": notes,
    }
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
