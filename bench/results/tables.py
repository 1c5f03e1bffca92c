"""The docs' results tables, rendered from bench/results/*.jsonl.

`TABLES` maps a name to a function returning one markdown table; docs/generate.py replaces
the text between `<!-- generated: NAME -->` and `<!-- /generated: NAME -->` in README.md
and docs/*.md with it, so the docs quote what the records hold and nothing typed by hand.
Each row is one CPU (or GPU) class, machine and setting: the latest measurement (the last
record of the latest date: files are kept in the order measured) and the range over the
runs behind it. Output depends only on the records (deterministic). Loaded by path (it
loads record.py beside it the same way), so it needs neither torch nor nmt.
"""

from __future__ import annotations

import importlib.util
import sys
from collections.abc import Callable, Iterable
from pathlib import Path
from types import ModuleType
from typing import Any

Record = dict[str, Any]


def _record_module() -> ModuleType:
    """bench/results/record.py, imported by its path (this file may itself be loaded by
    path, outside any package)."""
    name = "nmt_bench_results_record"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, Path(__file__).with_name(
            "record.py"))
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]


record = _record_module()

# CPU classes as nmt.kernels names them, fastest first (the tables' row order).
CLASS_ORDER = ("amx", "avx512_bf16", "avx512", "avx2_vnni", "avx2", "baseline")
DASH = "—"


def _load(kind: str) -> list[Record]:
    """The records of `kind` that a results table shows: not a bench's smoke or dry run."""
    return [r for r in record.load(kind) if not r["settings"].get("smoke")]


def _class_rank(rec: Record) -> int:
    cls = rec["cpu"].get("class")
    return CLASS_ORDER.index(cls) if cls in CLASS_ORDER else len(CLASS_ORDER)


def _kernels(rec: Record) -> str:
    """native, or the ISA caps a run was measured under."""
    return "capped at AVX2" if rec["cpu"].get("caps") else "native"


def _cpu(rec: Record) -> str:
    return rec["cpu"].get("model") or "not recorded"


def _cpu_key(rec: Record) -> tuple[int, str, str, str]:
    return (_class_rank(rec), str(rec["cpu"].get("class")), _cpu(rec), _kernels(rec))


def _groups(records: Iterable[Record], key: Callable[[Record], tuple]) -> dict[tuple, list]:
    """Records by `key`, each group in file order (so its last is its latest), the groups
    sorted by key."""
    found: dict[tuple, list[Record]] = {}
    for rec in records:
        found.setdefault(key(rec), []).append(rec)
    return dict(sorted(found.items(), key=lambda item: tuple(map(str, item[0]))))


def _latest(records: list[Record]) -> Record:
    """The last record of the latest date (stable: file order breaks ties)."""
    return max(enumerate(records), key=lambda ir: (ir[1]["date"], ir[0]))[1]


def _when(rec: Record) -> str:
    return f"{rec['date']} ({rec['commit']})"


def _num(value: float | None, digits: int = 1) -> str:
    """A figure with thousands separators, DASH where there is none."""
    if value is None:
        return DASH
    if isinstance(value, int) or float(value).is_integer() and digits == 0:
        return f"{int(value):,}"
    return f"{value:,.{digits}f}"


def _span(values: list[float], digits: int = 2, unit: str = "") -> str:
    """"lo-hi (N runs)", or "x (1 run)"."""
    values = [v for v in values if v is not None]
    if not values:
        return DASH
    runs = f"{len(values)} run{'s' if len(values) > 1 else ''}"
    lo, hi = min(values), max(values)
    if lo == hi:
        return f"{_num(lo, digits)}{unit} ({runs})"
    return f"{_num(lo, digits)}-{_num(hi, digits)}{unit} ({runs})"


def _markdown(header: list[str], rows: list[list[str]]) -> str:
    """A markdown table; `|` inside a cell escaped so every row has header's columns."""
    def line(cells: list[str]) -> str:
        assert len(cells) == len(header), (cells, header)
        return "| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |"

    return "\n".join([line(header), "|" + "---|" * len(header), *map(line, rows)])


def _empty(header: list[str], what: str) -> str:
    """A table with one row that says nothing is recorded yet (same column count)."""
    return _markdown(header, [[what] + [DASH] * (len(header) - 1)])


DemoRow = tuple[str, str, str, Any, Any, Record, list[Record]]


def _demo_rows() -> list[DemoRow]:
    """`make demo` records by machine, kernels, budget and training precision: (class, CPU,
    kernels, minutes, precision, the latest run, that machine's runs of the latest run's
    recipe), in table order."""
    groups = _groups(_load("demo"), lambda r: (*_cpu_key(r), r["settings"].get("minutes"),
                                               r["settings"].get("training_precision")))
    out = []
    for (_, cls, cpu, kernels, minutes, precision), runs in groups.items():
        last = _latest(runs)
        same = [r for r in runs if r["settings"].get("recipe") == last["settings"].get("recipe")]
        out.append((cls, cpu, kernels, minutes, precision, last, same))
    return out


def demo_table() -> str:
    """`make demo` by CPU class: the latest run's test2016 BLEU, minutes (install included
    on a clean clone) and updates, and the range over that machine's runs of the same
    recipe."""
    header = ["CPU class", "CPU", "kernels", "training", "budget", "latest (commit)",
              "test2016 BLEU", "minutes", "updates", "BLEU, runs of this recipe",
              "updates, runs of this recipe"]
    rows = []
    for cls, cpu, kernels, minutes, precision, last, same in _demo_rows():
        fig = last["figures"]
        rows.append([cls, cpu, kernels, str(precision), f"{minutes} min", _when(last),
                     _num(fig.get("bleu"), 2), _num(fig.get("minutes"), 1),
                     _num(fig.get("updates"), 0),
                     _span([r["figures"].get("bleu") for r in same]),
                     _span([r["figures"].get("updates") for r in same], 0)])
    return _markdown(header, rows) if rows else _empty(header, "no `make demo` recorded")


def demo_brief_table() -> str:
    """README's table: `make demo` by CPU class, narrow: the latest run's BLEU with the
    range of its machine's runs of the same recipe, minutes and updates."""
    header = ["CPU (class, kernels)", "training", "test2016 BLEU (runs)", "minutes",
              "updates"]
    rows = []
    for cls, cpu, kernels, minutes, precision, last, same in _demo_rows():
        bleus = [r["figures"].get("bleu") for r in same if r["figures"].get("bleu") is not None]
        spread = f"{min(bleus):.2f}-{max(bleus):.2f}, " if len(set(bleus)) > 1 else ""
        name = cpu.split(" (")[0]
        rows.append([f"{name} ({cls}{', capped at AVX2' if kernels != 'native' else ''})",
                     f"{precision}, {minutes} min", f"{_num(last['figures'].get('bleu'), 2)}"
                     f" ({spread}{len(bleus)} run{'s' if len(bleus) > 1 else ''})",
                     _num(last["figures"].get("minutes"), 1),
                     _num(last["figures"].get("updates"), 0)])
    return _markdown(header, rows) if rows else _empty(header, "no `make demo` recorded")


# nmt's precision -> the CTranslate2 compute type the docs compare it with
CT2_PEER = {"fp32": "float32", "int8": "int8", "auto": "int8", "bf16": "int8"}


def _ct2_peer(rec: Record) -> str:
    """The CTranslate2 compute type an nmt row is compared with: float32 for fp32 (and
    for `auto` where it resolved to fp32), int8 for int8 and bf16."""
    settings = rec["settings"]
    precision = settings.get("resolved_precision") or settings["precision"]
    return CT2_PEER.get(precision, precision)


def _peer(nmt_rec: Record, records: list[Record], system: str, key: str,
          value: str) -> Record | None:
    """The record of `system` from the same run as `nmt_rec` whose settings[key] is
    `value`."""
    for rec in records:
        if (rec["system"] == system and rec.get("run") == nmt_rec.get("run")
                and rec["date"] == nmt_rec["date"] and rec["settings"].get(key) == value
                and not rec["settings"].get("shortlist")):
            return rec
    return None


def _ratio(ours: float | None, theirs: float | None) -> float | None:
    return None if not ours or not theirs else ours / theirs


def translate_cpu_table() -> str:
    """`nmt translate` against CTranslate2 on a CPU (Multi30k test2016, beam 4, 2 cores and
    one thread), per CPU class, kernels and nmt precision: the latest run and the range of
    the 2-core ratio over runs."""
    header = ["CPU class", "CPU", "kernels", "nmt precision", "latest (commit)",
              "nmt sentences/s, 2 cores / 1 thread", "CTranslate2", "ratio, 2 cores / 1 thread",
              "ratio at 2 cores, all runs"]
    records = _load("translate-cpu")
    nmt = [r for r in records if r["system"] == "nmt" and not r["settings"].get("shortlist")
           and r["settings"].get("early_stop", "bound") == "bound"]
    if not nmt:
        return _empty(header, "no translation speed recorded")
    groups = _groups(nmt, lambda r: (*_cpu_key(r), r["settings"]["precision"]))
    rows = []
    for (_, cls, cpu, kernels, precision), runs in groups.items():
        ratios: list[tuple[float | None, float | None]] = []
        peers: list[Record | None] = []
        for rec in runs:
            compute = _ct2_peer(rec)
            peer = _peer(rec, records, "ctranslate2", "precision", compute)
            peers.append(peer)
            given = rec["figures"].get("vs_ctranslate2")
            if peer is not None:
                ratios.append((_ratio(rec["figures"].get("sentences_per_s"),
                                      peer["figures"].get("sentences_per_s")),
                               _ratio(rec["figures"].get("sentences_per_s_1_thread"),
                                      peer["figures"].get("sentences_per_s_1_thread"))))
            elif isinstance(given, dict):
                ratios.append((given.get("2_cores"), given.get("1_thread")))
            else:
                ratios.append((None, None))
        index = runs.index(_latest(runs))
        last, peer, (two, one) = runs[index], peers[index], ratios[index]
        fig = last["figures"]
        compute = _ct2_peer(last)
        theirs = (f"{compute}: {_num(peer['figures'].get('sentences_per_s'))} / "
                  f"{_num(peer['figures'].get('sentences_per_s_1_thread'))}"
                  if peer is not None else f"{compute}: not recorded")
        resolved = last["settings"].get("resolved_precision")
        label = precision + (f" ({resolved})" if resolved and resolved != precision else "")
        rows.append([cls, cpu, kernels, label, _when(last),
                     f"{_num(fig.get('sentences_per_s'))} / "
                     f"{_num(fig.get('sentences_per_s_1_thread'))}", theirs,
                     f"{_num(two, 2)}x / {_num(one, 2)}x" if two or one else DASH,
                     _span([r[0] for r in ratios], 2, "x")])
    return _markdown(header, rows)


def _train_pairs(records: list[Record]) -> list[tuple[tuple, Record | None, Record | None]]:
    """(row key, nmt's record, fairseq's record) per run and measure, in file order.
    Throughput: each system's best in the run. Race: each nmt mark against fairseq's best
    end-of-budget BLEU at its last mark in the same race (the docs' question: how soon nmt
    reaches what fairseq reaches in the whole budget)."""
    runs: dict[tuple[str, str], list[Record]] = {}
    for rec in records:
        runs.setdefault((rec["date"], rec.get("run", "")), []).append(rec)
    pairs: list[tuple[tuple, Record | None, Record | None]] = []
    for recs in runs.values():
        race = [r for r in recs if r["settings"].get("bench") == "race_multi30k"]
        rest = [r for r in recs if r not in race]
        measures: dict[tuple, dict[str, Record]] = {}
        for rec in rest:
            best = measures.setdefault((*_cpu_key(rec), rec["settings"].get("measure", "")), {})
            mine = best.get(rec["system"])
            if mine is None or _figure(rec) > _figure(mine):
                best[rec["system"]] = rec
        pairs += [(key, b.get("nmt"), b.get("fairseq")) for key, b in measures.items()]
        theirs = [r for r in race if r["system"] == "fairseq"]
        last = max((r["figures"]["minutes"] for r in theirs), default=None)
        peer = max((r for r in theirs if r["figures"]["minutes"] == last), key=_figure,
                   default=None)
        marks: dict[float, Record] = {}
        for rec in race:
            minutes = rec["figures"]["minutes"]
            if rec["system"] == "nmt" and (minutes not in marks
                                           or _figure(rec) > _figure(marks[minutes])):
                marks[minutes] = rec
        for minutes, rec in sorted(marks.items()):
            measure = f"test2016 BLEU: nmt at {minutes:g} min, fairseq at {last:g}"
            pairs.append(((*_cpu_key(rec), measure), rec, peer))
    return pairs


def train_cpu_table() -> str:
    """Training on a CPU against fairseq: tokens/s at equal batches (bench/
    train_throughput.py) and test2016 BLEU by the clock (bench/race_multi30k.py, each
    toolkit's best run that ended its schedule by the mark), per CPU class: the latest run
    of each measure and every run's comparison."""
    header = ["CPU class", "CPU", "kernels", "measure", "latest (commit)", "nmt", "fairseq",
              "nmt against fairseq", "all runs"]
    records = [r for r in _load("train-cpu") if not r["settings"].get("mid_run")]
    if not records:
        return _empty(header, "no training comparison recorded")
    grouped: dict[tuple, list[tuple[Record | None, Record | None]]] = {}
    for key, ours, theirs in _train_pairs(records):
        grouped.setdefault(key, []).append((ours, theirs))
    rows = []
    for key in sorted(grouped, key=lambda k: tuple(map(str, k))):
        _, cls, cpu, kernels, measure = key
        pairs = grouped[key]
        ours, theirs = max(enumerate(pairs), key=lambda ip: (
            (ip[1][0] or ip[1][1])["date"], ip[0]))[1]  # type: ignore[index]
        when = ours or theirs
        assert when is not None
        rows.append([cls, cpu, kernels, measure, _when(when), _cell(ours), _cell(theirs),
                     _against(ours, theirs),
                     "; ".join(_against(a, b) for a, b in pairs if a and b) or DASH])
    return _markdown(header, rows)


def _figure(rec: Record) -> float:
    """A train-cpu record's headline figure: tokens/s, else BLEU."""
    fig = rec["figures"]
    return float(fig.get("tokens_per_s") or fig.get("bleu") or 0.0)


def _cell(rec: Record | None) -> str:
    if rec is None:
        return DASH
    fig, settings = rec["figures"], rec["settings"]
    if "tokens_per_s" in fig:
        return f"{_num(fig['tokens_per_s'], 0)} tokens/s ({settings.get('precision')})"
    updates = fig.get("updates")
    return (f"{_num(fig.get('bleu'), 2)}"
            + (f" ({_num(updates, 0)} updates)" if updates else "")
            + (f", {settings['schedule']}" if settings.get("schedule") else ""))


def _against(ours: Record | None, theirs: Record | None) -> str:
    """tokens/s as a ratio, BLEU as a difference."""
    if ours is None or theirs is None:
        return DASH
    if "tokens_per_s" in ours["figures"]:
        return f"{ours['figures']['tokens_per_s'] / theirs['figures']['tokens_per_s']:.2f}x"
    return f"{ours['figures']['bleu'] - theirs['figures']['bleu']:+.2f} BLEU"


def _gpu(rec: Record) -> str:
    gpu = rec.get("gpu") or {}
    parts = [str(gpu.get("device") or "not recorded")]
    if gpu.get("torch"):
        parts.append(f"torch {gpu['torch']}")
    if gpu.get("cuda"):
        parts.append(f"CUDA {gpu['cuda']}")
    if gpu.get("driver"):
        parts.append(f"driver {gpu['driver']}")
    return ", ".join(parts)


def gpu_train_table() -> str:
    """Training speed on a GPU (bench/gpu_train_speed.py): per GPU, model, shape, mode and
    loss, the latest step time, tokens/s, MFU and peak memory, and the step time's range."""
    header = ["GPU", "arch", "GPUs (shape)", "mode", "loss", "latest (commit)", "ms/update",
              "tokens/s", "MFU", "peak memory", "ms/update, all runs"]
    records = _load("gpu-train")
    if not records:
        return _empty(header, "no GPU training speed recorded")
    groups = _groups(records, lambda r: (
        _gpu(r), r["settings"].get("arch"), r["settings"].get("gpus"),
        r["settings"].get("shape"), r["settings"].get("mode"), r["settings"].get("precision"),
        r["settings"].get("loss")))
    rows = []
    for (gpu, arch, gpus, shape, mode, precision, loss), runs in groups.items():
        last = _latest(runs)
        fig = last["figures"]
        mfu = fig.get("mfu")
        memory = fig.get("peak_memory_gib")
        rows.append([gpu, str(arch), f"{gpus} ({shape})", f"{mode}, {precision}", str(loss),
                     _when(last), _num(fig.get("step_time_ms")),
                     _num(fig.get("tokens_per_s"), 0),
                     DASH if mfu is None else f"{100 * mfu:.1f} %",
                     DASH if memory is None else f"{memory:.2f} GiB",
                     _span([r["figures"].get("step_time_ms") for r in runs], 1)])
    return _markdown(header, rows)


# nmt's GPU precision -> CTranslate2's compute type
GPU_PEER = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}


def gpu_translate_table() -> str:
    """Translation on a GPU against CTranslate2 (bench/gpu_translate_speed.py, beam 4):
    per GPU, model and precision, the latest sentences/s of each and the ratio's range."""
    header = ["GPU", "model", "nmt precision", "latest (commit)", "nmt sentences/s",
              "CTranslate2 sentences/s", "nmt / CTranslate2", "ratio, all runs"]
    records = _load("gpu-translate")
    nmt = [r for r in records if r["system"] == "nmt"]
    if not nmt:
        return _empty(header, "no GPU translation speed recorded yet")
    groups = _groups(nmt, lambda r: (_gpu(r), str(r["settings"].get("model")),
                                     r["settings"].get("precision")))
    rows = []
    for (gpu, model, precision), runs in groups.items():
        compute = GPU_PEER.get(precision, precision)
        peers = [_peer(r, records, "ctranslate2", "precision", compute) for r in runs]
        ratios = [_ratio(r["figures"].get("sentences_per_s"),
                         p["figures"].get("sentences_per_s") if p else None)
                  for r, p in zip(runs, peers, strict=True)]
        index = runs.index(_latest(runs))
        last, peer = runs[index], peers[index]
        rows.append([gpu, model, str(precision), _when(last),
                     _num(last["figures"].get("sentences_per_s")),
                     _num(peer["figures"].get("sentences_per_s")) if peer else DASH,
                     f"{ratios[index]:.2f}x" if ratios[index] else DASH,
                     _span(ratios, 2, "x")])
    return _markdown(header, rows)


def tune_table() -> str:
    """`nmt tune`'s rule against the alternatives on data no one tuned on (issue 73): per
    model, test2016 BLEU at the paper's alpha 0.6, at 1.0, at the best fixed alpha, at the
    arg-max of valid BLEU, and at what `nmt tune`'s rule (no-ramble) chose on valid;
    then the mean over models and the worst shortfall against the best fixed alpha."""
    header = ["model", "alpha 0.6", "alpha 1.0", "best fixed alpha", "valid arg-max",
              "nmt tune (no-ramble)"]
    records = _load("tune")
    if not records:
        return _empty(header, "no tuning evidence recorded")
    latest = {r["settings"]["model"]: r for r in records}  # the last record of each model
    columns: dict[str, list[float]] = {name: [] for name in header[1:]}
    best_of: list[float] = []
    rows = []
    for name, rec in latest.items():
        test, chosen = rec["figures"]["test_bleu"], rec["figures"]["chosen_alpha"]
        best = max(test, key=lambda a: test[a])
        cells = {"alpha 0.6": test["0.6"], "alpha 1.0": test["1.0"],
                 "best fixed alpha": test[best],
                 "valid arg-max": test[str(chosen["valid-argmax"])],
                 "nmt tune (no-ramble)": test[str(chosen["no-ramble"])]}
        picked = {"best fixed alpha": best, "valid arg-max": chosen["valid-argmax"],
                  "nmt tune (no-ramble)": chosen["no-ramble"]}
        for key, value in cells.items():
            columns[key].append(value)
        best_of.append(test[best])
        about = rec["settings"].get("about")
        rows.append([f"{name}{f' ({about})' if about else ''}"] + [
            f"{cells[k]:.2f}" + (f" ({picked[k]})" if k in picked else "") for k in header[1:]])
    rows.append(["mean"] + [f"{sum(v) / len(v):.2f}" for v in columns.values()])
    rows.append(["worst gap to the best fixed alpha"] + [
        f"{max(b - x for b, x in zip(best_of, v, strict=True)):.2f}" for v in columns.values()])
    return _markdown(header, rows)


# The rehearsal's stages in the order a user runs them (bench/wmt_rehearsal.py).
REHEARSAL_STAGES = ("prep", "bpe", "train", "average", "translate", "score-paper",
                    "score-sacrebleu")
EN_FR_PAIRS = 36_000_000  # the En-Fr recipe's training pairs, projected from the curve


def _rehearsal_run() -> list[Record]:
    """The latest full wmt-rehearsal run's records (its `run` id), in file order."""
    records = _load("wmt-rehearsal")
    if not records:
        return []
    last = _latest(records)
    return [r for r in records if r.get("run") == last.get("run")]


def _minutes(seconds: float | None) -> str:
    return DASH if seconds is None else f"{seconds / 60:.1f} min"


def _rehearsal_what(rec: Record) -> str:
    """What a stage did, in a few words."""
    fig, stage = rec["figures"], rec["settings"]["stage"]
    if stage == "prep":
        c = fig["cleaning"]
        dropped = {"empty": c["input"] - c["after_empty"],
                   "> 250 words": c["after_min_words"] - c["after_max_words"],
                   "ratio": c["after_max_words"] - c["after_max_ratio"],
                   "dev/test overlap": c["after_max_ratio"] - c["after_overlap"],
                   "duplicates": c["after_overlap"] - c["after_dedup"]}
        return (f"kept {c['output']:,} of {c['input']:,}; dropped " + ", ".join(
            f"{name} {n:,}" for name, n in dropped.items() if n))
    if stage == "bpe" and "vocab_s" in fig:
        return (f"vocabulary {_minutes(fig['vocab_s'])}, encoding "
                f"{_minutes(fig['encode_s'])}")
    if stage == "train":
        return (f"{rec['settings'].get('updates')} updates of "
                f"{_num(fig.get('tokens_per_update'), 0)} tokens (source + target): "
                f"{_num(fig.get('s_per_update'))} s each; data loaded in "
                f"{_num(fig.get('loader_s'))} s")
    if stage == "translate":
        return f"{fig['lines']:,} lines, {_num(fig['sentences_per_s'], 2)} sentences/s"
    if stage.startswith("score"):
        return f"BLEU {fig['bleu']:.2f} (after a few updates: not a quality figure)"
    return ""


def wmt_rehearsal_table() -> str:
    """The WMT14 En-De rehearsal (bench/wmt_rehearsal.py), the latest run: each stage's
    wall and CPU time, peak memory and the disk it leaves at each size, the wall time per
    pair against the smallest size's, and prep + bpe projected to the En-Fr recipe's 36M
    pairs from the largest size's cost per pair."""
    header = ["stage", "pairs", "wall", "CPU time", "peak memory", "disk left",
              "wall per 1M pairs (x smallest size's)", "what it did"]
    run = [r for r in _rehearsal_run() if r["system"] == "nmt"
           and r["settings"]["stage"] in REHEARSAL_STAGES]
    if not run:
        return _empty(header, "no WMT rehearsal recorded")
    rows = []
    for stage in REHEARSAL_STAGES:
        recs = sorted((r for r in run if r["settings"]["stage"] == stage),
                      key=lambda r: r["settings"]["pairs"])
        first = None
        for rec in recs:
            fig, pairs = rec["figures"], rec["settings"]["pairs"]
            per_million_s = fig["wall_s"] / pairs * 1_000_000  # seconds per 1M pairs
            first = first or per_million_s
            growth = (f"{_minutes(per_million_s)} ({per_million_s / first:.2f}x)"
                      if stage in ("prep", "bpe") else DASH)
            disk = fig.get("disk_mib")
            what = _rehearsal_what(rec)
            rows.append([stage, f"{pairs:,}", _minutes(fig["wall_s"]), _minutes(fig["cpu_s"]),
                         f"{fig['peak_mib'] / 1024:.2f} GiB",
                         DASH if disk is None else f"{disk / 1024:.2f} GiB", growth, what])
        if stage in ("prep", "bpe") and recs:
            last = recs[-1]
            scale = EN_FR_PAIRS / last["settings"]["pairs"]
            rows.append([stage, f"{EN_FR_PAIRS:,} (En-Fr, projected)",
                         _minutes(last["figures"]["wall_s"] * scale),
                         _minutes(last["figures"]["cpu_s"] * scale), DASH,
                         DASH if last["figures"].get("disk_mib") is None else
                         f"{last['figures']['disk_mib'] * scale / 1024:.1f} GiB", DASH,
                         f"the {last['settings']['pairs']:,}-pair cost per pair x "
                         f"{scale:.1f}"])
    cpu = run[0]
    rows.append(["machine", DASH, DASH, DASH, DASH, DASH, DASH,
                 f"{_cpu(cpu)} ({cpu['cpu'].get('class')}, {cpu['cpu'].get('cores')} cores), "
                 f"{_when(cpu)}"])
    return _markdown(header, rows)


def wmt_peers_table() -> str:
    """The rehearsal's peers on the same text, one after the other (the latest run):
    sentencepiece's own trainer against nmt bpe's vocabulary phase, and fairseq's path
    (pieces as text, fairseq-preprocess --workers 2) against nmt bpe's encoding."""
    header = ["work", "nmt", "peer", "peer's time", "nmt / peer", "peak memory, nmt / peer"]
    run = _rehearsal_run()
    pairs = max((r["settings"]["pairs"] for r in run), default=0)
    at = {(r["system"], r["settings"]["stage"]): r for r in run
          if r["settings"]["pairs"] == pairs}
    bpe = at.get(("nmt", "bpe"))
    vocab, pieces, binarize = (at.get(k) for k in (
        ("sentencepiece", "vocab"), ("sentencepiece", "encode-pieces"),
        ("fairseq", "binarize")))
    if bpe is None or vocab is None or pieces is None or binarize is None \
            or "vocab_s" not in bpe["figures"]:
        return _empty(header, "no peers recorded beside the WMT rehearsal")
    fig = bpe["figures"]
    peer_encode = pieces["figures"]["wall_s"] + binarize["figures"]["wall_s"]
    peer_total = vocab["figures"]["wall_s"] + peer_encode

    def mem(*recs: Record) -> str:
        return f"{max(r['figures']['peak_mib'] for r in recs) / 1024:.2f} GiB"

    rows = [
        [f"BPE vocabulary, {vocab['settings']['vocab_size']:,} pieces from a "
         f"{vocab['settings']['sample']:,}-line sample of {pairs:,} pairs",
         _minutes(fig["vocab_s"]), "sentencepiece's trainer (its own sampling)",
         _minutes(vocab["figures"]["wall_s"]),
         f"{fig['vocab_s'] / vocab['figures']['wall_s']:.2f}x",
         f"{mem(bpe)} (all of nmt bpe) / {mem(vocab)}"],
        ["encode and binarize train, valid, test (both sides)", _minutes(fig["encode_s"]),
         "pieces as text (sentencepiece, 2 threads), then fairseq-preprocess --workers 2",
         f"{_minutes(peer_encode)} ({_minutes(pieces['figures']['wall_s'])} + "
         f"{_minutes(binarize['figures']['wall_s'])})",
         f"{fig['encode_s'] / peer_encode:.2f}x", f"{mem(bpe)} / {mem(pieces, binarize)}"],
        ["binarize alone: nmt's encoding against fairseq-preprocess on ready pieces",
         _minutes(fig["encode_s"]), "fairseq-preprocess --workers 2",
         _minutes(binarize["figures"]["wall_s"]),
         f"{fig['encode_s'] / binarize['figures']['wall_s']:.2f}x",
         f"{mem(bpe)} / {mem(binarize)}"],
        ["all of it: nmt bpe against the peer path", _minutes(fig["wall_s"]),
         "the three above, one after the other", _minutes(peer_total),
         f"{fig['wall_s'] / peer_total:.2f}x", f"{mem(bpe)} / {mem(vocab, pieces, binarize)}"],
    ]
    return _markdown(header, rows)


TABLES: dict[str, Callable[[], str]] = {
    "results-demo": demo_table,
    "results-demo-brief": demo_brief_table,
    "results-translate-cpu": translate_cpu_table,
    "results-train-cpu": train_cpu_table,
    "results-gpu-train": gpu_train_table,
    "results-gpu-translate": gpu_translate_table,
    "results-tune": tune_table,
    "results-wmt-rehearsal": wmt_rehearsal_table,
    "results-wmt-peers": wmt_peers_table,
}


if __name__ == "__main__":  # python bench/results/tables.py [NAME...]: print them
    for name in sys.argv[1:] or TABLES:
        print(f"<!-- generated: {name} -->\n{TABLES[name]()}\n<!-- /generated: {name} -->\n")
