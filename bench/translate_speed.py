"""Translation speed: `nmt translate` vs CTranslate2 and fairseq, same weights, CPU, beam 4.

Each system at its best for the machine, and on one core: nmt at every split of --cores
into worker processes x torch threads (`--workers W --threads-per-worker T`), CTranslate2
at every inter_threads x intra_threads split (replicas sharing the weights, its documented
way to use cores for throughput) and at each of --ct2-batch-tokens; both with 1x1 too.
nmt rows: fp32, `auto` (bf16 where the CPU has it natively), int8; CTranslate2: float32 and
int8 (the checkpoint exported with `nmt export ct2`, run by bench/ct2_translate_speed.py in
bench/.venv-ct2, its `score_batch` log-probs checked against nmt's first); fairseq (below).
A peer whose virtual environment is absent is skipped with a note. `--isa avx2` runs
everything with the kernels capped at AVX2 (what an AVX2-only CPU gets). `--early-stop
beam` gives nmt the stopping rule CTranslate2 uses (it stops a sentence once `beam`
hypotheses have finished; nmt's default, the paper's rule, searches on while one could
still win): like with like.

Every configuration runs in a fresh process, one after the other: a warm-up of 20 lines,
then --repeats timed passes over the 1,000 Multi30k test sentences (test_2016_flickr.en)
by the same translator, the best kept (wall time; CPU time of the process and its workers
too); beam 4, length penalty 0.6, max length 0*src + 50, length-sorted batches. Memory of
nmt's rows: PSS of all its processes (shared pages split among them) and what each worker
holds privately. Ends with one JSON line; the CPU and its vector flags are named.

The model is --checkpoint if given (a trained one gives realistic output lengths),
otherwise the `small` shape (3+3 layers, d_model 256) with random init, seed 0, and a
Multi30k sentencepiece vocabulary (8,000 pieces) trained here. Random-init outputs mostly
run to the maximum length: a worst case for both systems, not a realistic mix.

fairseq parity: our state dict is converted to fairseq's TransformerModel names (fused QKV
split into q/k/v_proj). fairseq's sinusoids differ from the paper's (sin|cos halves,
positions offset by padding_idx + 1), so the fairseq model uses *learned* positions whose
table is filled with our sinusoids at the right offset; its dictionary order differs
(<s> <pad> </s> <unk>), so embedding rows are permuted; fairseq starts decoding with </s>,
so its (untied) decoder input embedding row of </s> holds our BOS embedding, and the output
projection is untied too. The helper checks the teacher-forced log-probs agree. Note that
fairseq's length penalty is |Y|^alpha (ours GNMT's ((5+|Y|)/6)^alpha) and its stopping
rule differs (it waits for `beam` finished hypotheses), so outputs may differ slightly.
fairseq runs fp32 with torch threads = --cores, its fastest mode on a CPU.

Quality check: every system's output is scored (sacreBLEU, detokenized, against
test_2016_flickr.de), and compared line by line with nmt fp32 1x1's, so a faster setting
that translates worse would show.

Trained-model setup (realistic output lengths, ~13 pieces per sentence): the model
`make demo` leaves (15 minutes of training on Multi30k, 5 checkpoints averaged), then
  .venv/bin/python bench/translate_speed.py --checkpoint runs/multi30k-en-de/average.pt
Run: .venv/bin/python bench/translate_speed.py [--checkpoint RUN/average.pt] [--isa avx2]
"""

from __future__ import annotations

import argparse
import dataclasses
import io
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from loss_speed import status_bytes  # noqa: E402  (bench/: /proc/self/status fields)
from results import record  # noqa: E402  (bench/results/record.py)
from serve_load import cpu_name  # noqa: E402  (bench/: the CPU and its vector flags)

from nmt.checkpoint import load_model, model_payload, save_checkpoint  # noqa: E402
from nmt.config import DecodeConfig, model_preset  # noqa: E402
from nmt.data.vocab import BOS_ID, EOS_ID, PAD_ID, UNK_ID, Vocab, train_vocab  # noqa: E402
from nmt.errors import UsageError  # noqa: E402
from nmt.inference.translate import Engine, translate_stream  # noqa: E402
from nmt.model.transformer import Transformer  # noqa: E402
from nmt.precision import resolve_precision  # noqa: E402
from nmt.score import corpus_scores  # noqa: E402

DATA = Path(os.environ.get("NMT_SHARED_DATA", REPO.parent / "shared" / "data")) / "multi30k"
FAIRSEQ_PY = REPO / "bench" / ".venv-fairseq" / "bin" / "python"
CT2_PY = REPO / "bench" / ".venv-ct2" / "bin" / "python"
# fairseq index -> our index: <s> <pad> </s> <unk> then the same pieces.
SPECIALS = [BOS_ID, PAD_ID, EOS_ID, UNK_ID]


def build_model(cache: Path, vocab_size: int, seed: int) -> Path:
    """Random-init `small` model with a Multi30k vocabulary, cached."""
    cache.mkdir(parents=True, exist_ok=True)
    spm = cache / f"spm{vocab_size}.model"
    if not spm.exists():
        train_vocab([DATA / "train.en", DATA / "train.de"], spm, vocab_size, threads=2)
    path = cache / f"small_seed{seed}_v{vocab_size}.pt"
    if not path.exists():
        proto = spm.read_bytes()
        cfg = model_preset("small", vocab_size=len(Vocab(proto)))
        torch.manual_seed(seed)
        model = Transformer(cfg)
        save_checkpoint(model_payload(step=0, model_config=cfg.to_dict(), vocab=proto,
                                      model=model.state_dict(),
                                      meta={"src_lang": "en", "tgt_lang": "de"}), path)
    return path


def to_fairseq(model: Transformer) -> tuple[dict[str, torch.Tensor], list[int]]:
    """Our state dict under fairseq TransformerModel names (see module docstring)."""
    cfg = model.config
    sd = {k: v.detach().clone() for k, v in model.state_dict().items()}
    fair_to_ours = SPECIALS + list(range(4, cfg.vocab_size))
    emb = sd["embed.weight"][fair_to_ours]  # (V, D) in fairseq order
    dec_in = emb.clone()
    dec_in[2] = sd["embed.weight"][BOS_ID]  # fairseq feeds </s> where we feed BOS
    d = cfg.d_model
    table = model.enc_positions.table  # (max_positions, D) paper sinusoids
    pos = torch.zeros(cfg.max_positions + 2, d)
    pos[2:] = table  # fairseq position of token i is padding_idx + 1 + i
    out = {"encoder.embed_tokens.weight": emb, "decoder.embed_tokens.weight": dec_in,
           "decoder.output_projection.weight": emb.clone(),
           "encoder.embed_positions.weight": pos, "decoder.embed_positions.weight": pos.clone()}

    def split(prefix: str, src: str, names: tuple[str, ...]) -> None:
        for kind in ("weight", "bias"):
            for name, chunk in zip(names, sd[f"{src}.{kind}"].split(d, dim=0), strict=True):
                out[f"{prefix}.{name}.{kind}"] = chunk.clone()

    def copy(dst: str, src: str) -> None:
        for kind in ("weight", "bias"):
            out[f"{dst}.{kind}"] = sd[f"{src}.{kind}"]

    for i in range(cfg.encoder_layers):
        f, o = f"encoder.layers.{i}", f"encoder.{i}"
        split(f"{f}.self_attn", f"{o}.self_attn.qkv", ("q_proj", "k_proj", "v_proj"))
        copy(f"{f}.self_attn.out_proj", f"{o}.self_attn.out")
        copy(f"{f}.self_attn_layer_norm", f"{o}.res_attn.norm")
        copy(f"{f}.fc1", f"{o}.ffn.fc1")
        copy(f"{f}.fc2", f"{o}.ffn.fc2")
        copy(f"{f}.final_layer_norm", f"{o}.res_ffn.norm")
    for i in range(cfg.decoder_layers):
        f, o = f"decoder.layers.{i}", f"decoder.{i}"
        split(f"{f}.self_attn", f"{o}.self_attn.qkv", ("q_proj", "k_proj", "v_proj"))
        copy(f"{f}.self_attn.out_proj", f"{o}.self_attn.out")
        copy(f"{f}.self_attn_layer_norm", f"{o}.res_self.norm")
        copy(f"{f}.encoder_attn.q_proj", f"{o}.cross_attn.q")
        split(f"{f}.encoder_attn", f"{o}.cross_attn.kv", ("k_proj", "v_proj"))
        copy(f"{f}.encoder_attn.out_proj", f"{o}.cross_attn.out")
        copy(f"{f}.encoder_attn_layer_norm", f"{o}.res_cross.norm")
        copy(f"{f}.fc1", f"{o}.ffn.fc1")
        copy(f"{f}.fc2", f"{o}.ffn.fc2")
        copy(f"{f}.final_layer_norm", f"{o}.res_ffn.norm")
    return out, fair_to_ours


def export_for_fairseq(model: Transformer, vocab: Vocab, lines: list[str], cfg: DecodeConfig,
                       path: Path) -> None:
    """Weights, sources in fairseq ids, search settings and a parity check batch."""
    state, fair_to_ours = to_fairseq(model)
    ours_to_fair = [0] * len(fair_to_ours)
    for f, o in enumerate(fair_to_ours):
        ours_to_fair[o] = f
    ids = [ids[: model.config.max_positions - 1] for ids in vocab.encode(lines)]
    sources = [[ours_to_fair[i] for i in (*s, EOS_ID)] for s in ids if s]
    check_ids = ids[:8]
    src = torch.full((8, max(map(len, check_ids)) + 1), PAD_ID)
    for r, s in enumerate(check_ids):
        src[r, : len(s) + 1] = torch.tensor([*s, EOS_ID])
    tgt = [ids[8 + r][:10] for r in range(8)]  # any target prefix of 10 pieces
    tgt_in = torch.tensor([[BOS_ID, *t, *[4] * (10 - len(t))] for t in tgt])  # (8, 11)
    with torch.no_grad():
        logp = torch.log_softmax(model(src, tgt_in).float(), -1)  # (8, 11, V) our order
    prev = [[2, *(ours_to_fair[i] for i in row[1:])] for row in tgt_in.tolist()]
    check = {"src": [[ours_to_fair[i] for i in (*s, EOS_ID)] for s in check_ids],
             "prev": prev, "logp": logp.tolist()}
    torch.save({"config": model.config.to_dict(), "state": state, "sources": sources,
                "ours_to_fair": ours_to_fair, "check": check,
                "search": {"beam": cfg.beam, "lenpen": cfg.alpha, "max_len_a": cfg.max_len_a,
                           "max_len_b": cfg.max_len_b, "max_tokens": cfg.max_tokens}}, path)



def time_ours(checkpoint: Path, lines: list[str], refs: list[str], cfg: DecodeConfig,
              precision: str, passes: int = 1, workers: int = 1,
              threads: int = 1, repeats: int = 1, shortlist: Path | None = None
              ) -> dict[str, object]:
    """`nmt translate`'s stream path over `lines` at `precision` with `workers` processes of
    `threads` torch threads (after a 20-line warm-up); best of `repeats` timed passes.

    Run in a fresh process per configuration (`child_main`): forking workers from a process
    whose OpenMP pool already ran would hang them (nmt/inference/workers.py), and no
    configuration inherits another's memory. With `passes` > 1 the translator first goes
    over `lines` passes - 1 times untimed: the steady state of a long input.
    `rss_growth_mb` is the resident memory added between the end of the first pass and
    the end of the last: about 0 unless something accumulates. Memory of the workers:
    `pss_mb` (all processes, shared pages split among them) and each worker's private
    pages (`worker_private_mb`, what a worker adds)."""
    if workers == 1:
        torch.set_num_threads(threads)
    translator = Engine.load([checkpoint], cfg, device="cpu", precision=precision,
                                 workers=workers, threads=threads, shortlist=shortlist)
    data = ("\n".join(lines) + "\n").encode()
    translate_stream(io.BytesIO(("\n".join(lines[:20]) + "\n").encode()), io.BytesIO(),
                     translator)  # warm-up
    rss_first = None
    for _ in range(passes - 1):
        translate_stream(io.BytesIO(data), io.BytesIO(), translator)
        rss_first = status_bytes("VmRSS") / 2 ** 20 if rss_first is None else rss_first
    best = None
    for _ in range(repeats):
        sink = io.BytesIO()
        start, cpu_start = time.perf_counter(), _cpu_seconds(translator)
        stats = translate_stream(io.BytesIO(data), sink, translator)
        seconds, cpu = time.perf_counter() - start, _cpu_seconds(translator) - cpu_start
        if best is None or seconds < best[0]:
            best = (seconds, cpu, stats, sink)
    seconds, cpu, stats, sink = best
    rss_end = status_bytes("VmRSS") / 2 ** 20  # resident MiB (Linux /proc)
    memory = _memory(translator)
    translator.close()
    hyps = sink.getvalue().decode("utf-8").splitlines()
    return {"system": "nmt", "precision": precision,
            "shortlist": None if shortlist is None else str(shortlist),
            "workers": workers, "threads": threads, "max_tokens": translator.max_tokens,
            "bleu": corpus_scores(hyps, refs, digits=2)["bleu"], "hyps": hyps,
            "resolved_precision": resolve_precision(precision, torch.device("cpu")),
            "sentences": stats.sentences, "tgt_tokens": stats.tgt_tokens,
            "seconds": seconds, "sentences_per_s": stats.sentences / seconds,
            "tokens_per_s": stats.tgt_tokens / seconds, "cpu_seconds": cpu,
            "sentences_per_cpu_s": stats.sentences / cpu,
            "tokens_per_cpu_s": stats.tgt_tokens / cpu, "passes": passes, "rss_mb": rss_end,
            "rss_growth_mb": None if rss_first is None else rss_end - rss_first, **memory}


def _cpu_seconds(translator: Engine) -> float:
    """CPU time of this process and its worker processes so far (Linux /proc)."""
    total = time.process_time()
    ticks = os.sysconf("SC_CLK_TCK")
    for pid in ([] if translator.pool is None else translator.pool.pids):
        with open(f"/proc/{pid}/stat", encoding="ascii") as handle:
            fields = handle.read().rsplit(")", 1)[1].split()
        total += (int(fields[11]) + int(fields[12])) / ticks  # utime + stime
    return total


def _smaps(pid: int | str) -> dict[str, float]:
    """Pss and private memory of a process in MiB (/proc/PID/smaps_rollup)."""
    values: dict[str, float] = {}
    with open(f"/proc/{pid}/smaps_rollup", encoding="ascii") as handle:
        for line in handle:
            parts = line.split()
            if len(parts) >= 2 and parts[0].rstrip(":") in ("Pss", "Private_Clean",
                                                             "Private_Dirty", "Rss"):
                values[parts[0].rstrip(":")] = int(parts[1]) / 1024
    return values


def _memory(translator: Engine) -> dict[str, object]:
    """Memory of the parent and its workers after the timed passes."""
    own = _smaps("self")
    workers = [_smaps(pid) for pid in ([] if translator.pool is None else translator.pool.pids)]
    return {"pss_mb": own["Pss"] + sum(w["Pss"] for w in workers),
            "parent_rss_mb": own["Rss"],
            "worker_private_mb": [w["Private_Clean"] + w["Private_Dirty"] for w in workers],
            "worker_rss_mb": [w["Rss"] for w in workers]}


def child_main(request: Path) -> None:
    """Time one nmt configuration (a JSON request written by `run_nmt`) and print its row
    as one JSON line."""
    req = json.loads(request.read_text(encoding="utf-8"))
    cfg = DecodeConfig(**req["cfg"])
    row = time_ours(Path(req["checkpoint"]), req["lines"], req["refs"], cfg, req["precision"],
                    req["passes"], req["workers"], req["threads"],
                    req["repeats"], Path(req["shortlist"]) if req["shortlist"] else None)
    print(json.dumps(row))


def run_nmt(checkpoint: Path, lines: list[str], refs: list[str], cfg: DecodeConfig,
            precision: str, passes: int, workers: int, threads: int,
            repeats: int, cache: Path, shortlist: Path | None = None) -> dict[str, object]:
    """`time_ours` in a fresh Python process (see there)."""
    request = cache / "nmt_request.json"
    request.write_text(json.dumps({
        "checkpoint": str(checkpoint), "lines": lines, "refs": refs,
        "cfg": dataclasses.asdict(cfg), "precision": precision,
        "passes": passes, "workers": workers, "threads": threads, "repeats": repeats,
        "shortlist": None if shortlist is None else str(shortlist)}),
        encoding="utf-8")
    proc = subprocess.run([sys.executable, __file__, "--child", str(request)],
                          capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise SystemExit(f"nmt {precision} {workers}x{threads} failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def ct2_request(checkpoint: Path, lines: list[str], cfg: DecodeConfig, cache: Path
                ) -> Path | None:
    """Export `checkpoint` with `nmt export ct2` (float32 weights; CTranslate2 quantizes
    at load time for int8) and write the helper's request: sources as pieces, search
    settings, and a parity batch with nmt's teacher-forced per-token log-probs."""
    try:
        from nmt.inference.export.ct2 import export_ct2
    except ImportError:
        return None
    model_dir = cache / "ct2_model"
    try:
        export_ct2(checkpoint, model_dir, force=True)
    except UsageError as err:  # ctranslate2 missing in this venv
        print(f"ctranslate2 rows skipped: {err}", file=sys.stderr)
        return None
    model, vocab, _ = load_model(checkpoint, "cpu")
    ids = [s[: model.config.max_positions - 1] for s in vocab.encode(lines)]
    src, tgt = ids[:8], [ids[8 + r][:10] for r in range(8)]  # any targets do for parity
    log_probs = []
    with torch.no_grad():
        for s, t in zip(src, tgt, strict=True):
            lp = torch.log_softmax(model(torch.tensor([[*s, EOS_ID]]),
                                         torch.tensor([[BOS_ID, *t]])).float(), -1)[0]
            log_probs.append(lp.gather(1, torch.tensor([*t, EOS_ID])[:, None])[:, 0].tolist())
    request = {"model_dir": str(model_dir), "sources": [vocab.pieces(s) for s in ids],
               "check": {"sources": [vocab.pieces(s) for s in src],
                         "targets": [vocab.pieces(t) for t in tgt], "log_probs": log_probs},
               "beam": cfg.beam, "alpha": cfg.alpha, "max_len_b": cfg.max_len_b,
               "max_tokens": cfg.max_tokens}
    path = cache / "ct2_request.json"
    path.write_text(json.dumps(request), encoding="utf-8")
    return path


def time_ct2(request: Path, grid: list[tuple[int, int]], batch_tokens: list[int],
             vocab: Vocab, refs: list[str], passes: int = 1, repeats: int = 1
             ) -> dict[str, dict]:
    """CTranslate2 float32 and int8 rows, one per inter_threads x intra_threads of `grid`
    and batch size of `batch_tokens`, from the helper in bench/.venv-ct2 (the same warm-up,
    `passes` and `repeats` as nmt's rows)."""
    proc = subprocess.run([str(CT2_PY), str(REPO / "bench" / "ct2_translate_speed.py"),
                           str(request), "--grid", ",".join(f"{i}x{t}" for i, t in grid),
                           "--batch-tokens", ",".join(map(str, batch_tokens)),
                           "--passes", str(passes), "--repeats", str(repeats)],
                          capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise SystemExit(f"CTranslate2 side failed:\n{proc.stderr[-3000:]}")
    rows = json.loads(proc.stdout.strip().splitlines()[-1])
    piece_id = {p: i for i, p in enumerate(vocab.pieces(range(len(vocab))))}
    for row in rows.values():
        row["hyps"] = vocab.decode([[piece_id[p] for p in h] for h in row["hyps"]])
        row["bleu"] = corpus_scores(row["hyps"], refs, digits=2)["bleu"]
    return rows


def time_fairseq(checkpoint: Path, lines: list[str], cfg: DecodeConfig, cache: Path,
                 threads: int, refs: list[str]) -> dict[str, object]:
    """The fairseq row from the helper in bench/.venv-fairseq."""
    model, vocab, _ = load_model(checkpoint, "cpu")
    export = cache / "fairseq_export.pt"
    export_for_fairseq(model, vocab, lines, cfg, export)
    env = dict(os.environ, TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD="1")
    proc = subprocess.run([str(FAIRSEQ_PY), str(REPO / "bench" / "fairseq_translate_speed.py"),
                           str(export), "--threads", str(threads)], env=env,
                          capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise SystemExit(f"fairseq side failed:\n{proc.stderr[-3000:]}")
    fair = json.loads(proc.stdout.strip().splitlines()[-1])
    fair["hyps"] = vocab.decode(fair.pop("hyps"))
    fair["bleu"] = corpus_scores(fair["hyps"], refs, digits=2)["bleu"]
    return fair


def keep_best(best: dict[str, dict], name: str, row: dict) -> None:
    """Keep the faster (wall time) of two timings of one system; CPU time is kept as the
    minimum over repeats too."""
    old = best.get(name)
    if old is None:
        best[name] = row
        return
    cpu = min(old["cpu_seconds"], row["cpu_seconds"])
    if row["seconds"] < old["seconds"]:
        best[name] = row
    keep = best[name]
    keep["cpu_seconds"] = cpu
    keep["sentences_per_cpu_s"] = keep["sentences"] / cpu
    keep["tokens_per_cpu_s"] = keep["tgt_tokens"] / cpu


def configurations(text: str, cores: int) -> list[tuple[int, int]]:
    """(processes or replicas, threads each) from "2x1,1x2"; empty: every split of `cores`
    (W x T with W * T = cores) and the one-thread row 1x1."""
    if text:
        return [(int(a), int(b)) for a, b in (item.lower().split("x")
                                              for item in text.split(","))]
    splits = [(w, cores // w) for w in range(cores, 0, -1) if cores % w == 0]
    return splits + ([(1, 1)] if (1, 1) not in splits else [])


ISA_CAPS = {"ONEDNN_MAX_CPU_ISA": "AVX2", "ATEN_CPU_CAPABILITY": "avx2",
            "MKL_ENABLE_INSTRUCTIONS": "AVX2", "FBGEMM_ENABLE_INSTRUCTIONS": "AVX2",
            "CT2_FORCE_CPU_ISA": "AVX2"}  # what an AVX2-only CPU runs (as `make test`'s isa pass)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--checkpoint", type=Path, default=None)
    parser.add_argument("--cache", type=Path, default=Path("/tmp/nmt_bench_translate"))
    parser.add_argument("--vocab-size", type=int, default=8000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--sentences", type=int, default=1000)
    parser.add_argument("--max-tokens", type=int, default=None,
                        help="nmt's batch size (default: nmt translate's, 2048 on a CPU).")
    parser.add_argument("--early-stop", default="bound", choices=["bound", "beam"],
                        help="nmt's stopping rule (beam: CTranslate2's, like with like).")
    parser.add_argument("--shortlist", type=Path, default=None,
                        help="Also time nmt's rows with this `nmt shortlist` file.")
    parser.add_argument("--ct2-batch-tokens", default="4096,2048,1024",
                        help="CTranslate2's max_batch_size values (tokens) tried; its best "
                             "is reported.")
    parser.add_argument("--cores", type=int, default=len(os.sched_getaffinity(0)),
                        help="Cores to use; configurations split them (see --configs).")
    parser.add_argument("--configs", default="",
                        help="nmt WORKERSxTHREADS and CTranslate2 INTERxINTRA list (e.g. "
                             "2x1,1x2,1x1); default: every split of --cores, and 1x1.")
    parser.add_argument("--threads", type=int, default=None,
                        help="Old form: one configuration, 1 x THREADS, for every system.")
    parser.add_argument("--isa", choices=["native", "avx2"], default="native",
                        help="avx2: rerun with every library's kernels capped at AVX2 "
                             "(no AVX-512, no native bf16): what an AVX2-only CPU gets.")
    parser.add_argument("--repeats", type=int, default=2,
                        help="Timed passes per translator (and per CTranslate2 replica "
                             "set), the best kept.")
    parser.add_argument("--rounds", type=int, default=1,
                        help="Times every system and configuration is run, interleaved; "
                             "each keeps its best.")
    parser.add_argument("--passes", type=int, default=1,
                        help="Passes over the input by one translator (nmt and CTranslate2), "
                             "the last timed: the steady state of a long input; >1 also "
                             "reports nmt's resident-memory growth.")
    parser.add_argument("--systems", default="fp32,auto,int8,ct2",
                        help="Comma list among fp32, auto, int8, ct2, fairseq.")
    parser.add_argument("--skip-fairseq", action="store_true")
    parser.add_argument("--skip-ct2", action="store_true")
    record.add_argument(parser, "translate-cpu")
    parser.add_argument("--smoke", action="store_true",
                        help="Cheap check: 40 sentences, nmt only, 1x1 and the cores split.")
    parser.add_argument("--child", type=Path, default=None, help=argparse.SUPPRESS)
    opts = parser.parse_args()
    if opts.child is not None:
        child_main(opts.child)
        return
    if opts.isa == "avx2" and os.environ.get("ONEDNN_MAX_CPU_ISA") != "AVX2":
        os.execve(sys.executable, [sys.executable, *sys.argv], {**os.environ, **ISA_CAPS})
    systems = opts.systems.split(",")
    if opts.smoke:
        opts.sentences, opts.repeats, opts.rounds, systems = 40, 1, 1, ["fp32", "int8"]
    if opts.skip_fairseq or not FAIRSEQ_PY.exists():
        systems = [s for s in systems if s != "fairseq"]
    if opts.skip_ct2 or not CT2_PY.exists():
        systems = [s for s in systems if s != "ct2"]
    for peer, python in (("fairseq", FAIRSEQ_PY), ("ct2", CT2_PY)):
        if peer in opts.systems.split(",") and peer not in systems and not opts.smoke:
            print(f"{peer} rows skipped: {python} not found (see its helper's docstring)",
                  file=sys.stderr)
    grid = ([(1, opts.threads)] if opts.threads else configurations(opts.configs, opts.cores))
    opts.cache.mkdir(parents=True, exist_ok=True)
    checkpoint = opts.checkpoint or build_model(opts.cache, opts.vocab_size, opts.seed)
    lines = (DATA / "test_2016_flickr.en").read_text(encoding="utf-8").split("\n")
    lines = lines[: opts.sentences]
    refs = (DATA / "test_2016_flickr.de").read_text(encoding="utf-8").splitlines()
    cfg = DecodeConfig(beam=4, alpha=0.6, max_len_a=0.0, max_len_b=50,
                       max_tokens=opts.max_tokens, buffer_size=len(lines),
                       early_stop=opts.early_stop)
    _, vocab, _ = load_model(checkpoint, "cpu")
    request = None
    if "ct2" in systems:
        ct2_cfg = dataclasses.replace(cfg, max_tokens=opts.max_tokens or 2048)
        request = ct2_request(checkpoint, lines, ct2_cfg, opts.cache)
        if request is None:
            systems.remove("ct2")
    nmt_runs = ("fp32", "auto", "int8")
    if opts.shortlist is not None:  # the same precisions again, with the shortlist
        systems += [f"{name}+shortlist" for name in systems if name in nmt_runs]
    best: dict[str, dict] = {}
    for _ in range(opts.rounds):  # interleaved: this VM drifts 10-20 % over minutes
        for name in systems:  # one system after another, each alone on the machine
            if name.split("+")[0] in nmt_runs:
                precision = name.split("+")[0]
                listed = opts.shortlist if name.endswith("+shortlist") else None
                for workers, threads in grid:
                    row = run_nmt(checkpoint, lines, refs, cfg, precision, opts.passes,
                                  workers, threads, opts.repeats, opts.cache, listed)
                    keep_best(best, f"{name}@{workers}x{threads}", row)
                    print(f"nmt {name} {workers}x{threads}: {row['sentences_per_s']:.1f} "
                          "sentences/s", file=sys.stderr)
            elif name == "ct2":
                assert request is not None
                sizes = [int(x) for x in opts.ct2_batch_tokens.split(",")]
                for key, row in time_ct2(request, grid, sizes, vocab, refs, opts.passes,
                                         opts.repeats).items():
                    keep_best(best, f"ct2_{key}", row)
            elif name == "fairseq":
                threads = max(t * w for w, t in grid)
                torch.set_num_threads(threads)
                keep_best(best, "fairseq", time_fairseq(checkpoint, lines, cfg, opts.cache,
                                                        threads, refs))
    report(best, opts, checkpoint, grid)


def _best_of(best: dict[str, dict], prefix: str, grid_key: str | None = None
             ) -> tuple[str, dict] | None:
    """The fastest row whose name starts with `prefix` (at one configuration when
    `grid_key`, e.g. "1x1", is given)."""
    rows = [(k, r) for k, r in best.items() if k.startswith(prefix)
            and (grid_key is None or f"@{grid_key}" in k)]
    return max(rows, key=lambda kr: kr[1]["sentences_per_s"]) if rows else None


def report(best: dict[str, dict], opts: argparse.Namespace, checkpoint: Path,
           grid: list[tuple[int, int]]) -> None:
    """The table (stdout), each system's best against CTranslate2's best, and one JSON
    line."""
    cpu = cpu_name()
    isa = "AVX2 caps" if os.environ.get("ONEDNN_MAX_CPU_ISA") == "AVX2" else "native"
    print(f"CPU: {cpu}; kernels: {isa}; {opts.cores} cores; nmt --early-stop "
          f"{opts.early_stop}")
    base_row = _best_of(best, "fp32@", "1x1")
    base = None if base_row is None else base_row[1]["hyps"]
    print(f"{'system':<34}{'sent/s':>9}{'sent/CPU-s':>12}{'BLEU':>7}{'same as fp32 1x1':>18}"
          f"{'memory':>28}")
    for name, row in best.items():
        same = "" if base is None else \
            f"{sum(a == b for a, b in zip(row['hyps'], base, strict=True)) / len(base):.3f}"
        row["same_as_nmt_fp32_1x1"] = same
        label = f"nmt {name} ({row['resolved_precision']})" if row["system"] == "nmt" else name
        memory = ""
        if row["system"] == "nmt":
            private = row.get("worker_private_mb") or []
            memory = (f"PSS {row['pss_mb']:.0f} MiB" + (
                f", +{max(private):.0f}/worker" if private else ""))
        print(f"{label:<34}{row['sentences_per_s']:>9.1f}{row['sentences_per_cpu_s']:>12.1f}"
              f"{row['bleu']:>7.2f}{same:>18}{memory:>28}")
    result: dict[str, object] = {"bench": "translate_speed", "checkpoint": str(checkpoint),
                                 "cpu": cpu, "isa": isa, "cores": opts.cores,
                                 "early_stop": opts.early_stop,
                                 "grid": [f"{w}x{t}" for w, t in grid], "beam": 4,
                                 "alpha": 0.6, "max_len_b": 50, "repeats": opts.repeats,
                                 "rounds": opts.rounds,
                                 "passes": opts.passes, "sentences": opts.sentences}
    targets = [("int8@", "ct2_int8@"), ("fp32@", "ct2_float32@"), ("auto@", "ct2_int8@"),
               ("int8+shortlist@", "ct2_int8@"), ("auto+shortlist@", "ct2_int8@")]
    for scope, key in (("best", None), ("one thread", "1x1")):
        for ours, peer in targets:
            mine, theirs = _best_of(best, ours, key), _best_of(best, peer, key)
            if mine is None or theirs is None:
                continue
            wall = mine[1]["sentences_per_s"] / theirs[1]["sentences_per_s"]
            print(f"{scope}: nmt {mine[0]} / {theirs[0]}: {wall:.2f}x sentences/s "
                  "(target >= 1.0x)")
            result[f"speedup_{scope.replace(' ', '_')}_{ours[:-1]}_vs_{peer[:-1]}"] = wall
    for row in best.values():
        row.pop("hyps", None)
    result["rows"] = best
    result["load_average_1_5_15"] = list(os.getloadavg())
    from nmt.doctor import report as machine  # beside every figure
    doctor = machine(measure=False)
    print(json.dumps({**result, "doctor": doctor}))
    record.write(records(best, opts, doctor), opts.record)


def records(best: dict[str, dict], opts: argparse.Namespace, doctor: dict) -> list[dict]:
    """One translate-cpu record (bench/results/README.md) per system, precision and
    shortlist: its best configuration's sentences/s and its one-thread figure."""
    run = record.run_id()
    found = []
    names = dict.fromkeys(key.split("@")[0] for key in best)  # fp32, ct2_int8, ... in order
    for name in names:
        top = _best_of(best, f"{name}@")
        if top is None:
            continue
        one = _best_of(best, f"{name}@", "1x1")
        row = top[1]
        system = row["system"]
        precision = row["compute_type"] if system == "ctranslate2" else name.split("+")[0]
        settings = {"precision": precision, "shortlist": name.endswith("+shortlist"),
                    "cores": opts.cores, "beam": 4, "alpha": 0.6, "early_stop": opts.early_stop,
                    "sentences": opts.sentences, "repeats": opts.repeats,
                    "rounds": opts.rounds, "passes": opts.passes, "smoke": opts.smoke,
                    "checkpoint": str(opts.checkpoint) if opts.checkpoint else "random small"}
        if system == "nmt":
            settings["resolved_precision"] = row["resolved_precision"]
        figures = {"sentences_per_s": row["sentences_per_s"],
                   "best_config": top[0].split("@")[1],
                   "sentences_per_s_1_thread": one[1]["sentences_per_s"] if one else None,
                   "bleu": row.get("bleu")}
        found.append(record.make("translate-cpu", system, settings, figures, doctor, run=run))
    return found


if __name__ == "__main__":
    main()
