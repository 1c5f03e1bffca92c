"""The WMT14 En-De recipe at real size, every stage, on this machine: a rehearsal.

For each size in --pairs it builds, outside the repository, the recipe's five archives
(bench/_wmt_corpus.py: real layouts and member names, training text recombined from real
sentences, the real newstest2013/2014 as dev and test) and a copy of the recipe whose
checksums are those of the built files, then runs `nmt prep` and `nmt bpe` (37,000 pieces)
as a user would. At the largest size it goes on: `nmt train --arch base` for --updates
updates at the paper's 25,000-token batches (update-freq derived on a CPU), a checkpoint
each update, `nmt average`, `nmt translate` of all of newstest2014, `nmt score --paper`
(the Moses language from the prepared data) and sacreBLEU; then the peers on the same text
one after the other: sentencepiece's own trainer at the same settings and sample, and
fairseq's path (the same pieces as text, `fairseq-preprocess --workers 2`).

Each stage runs as its own process tree (bench/_stage_meter.py): wall and CPU time, peak
memory (Pss of the tree), and the disk it leaves. Prints one JSON line per stage;
--record appends them as wmt-rehearsal records (bench/results/), whose tables
(results-wmt-rehearsal, results-wmt-peers) docs/wmt14.md shows.

    .venv/bin/python bench/wmt_rehearsal.py --record     # 0.5M, 1M, 2M, 4.5M: about 2 h
    .venv/bin/python bench/wmt_rehearsal.py --smoke      # 3,000 pairs, tiny model: 2 min
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "bench"))

import _wmt_corpus as corpus  # noqa: E402
from _race_fairseq import ENV as FAIRSEQ_ENV  # noqa: E402
from _race_fairseq import ensure_venv, write_dict  # noqa: E402
from _stage_meter import Measured, disk_bytes, run_stage  # noqa: E402
from results import record  # noqa: E402

SHARED = Path(os.environ.get("NMT_SHARED_DATA", REPO.parent / "shared" / "data"))
NMT = [str(Path(sys.executable).parent / "nmt")]  # the console script of this venv
RECIPE = REPO / "recipes" / "wmt14-en-de.toml"
EN_FR_PAIRS = 36_000_000  # the En-Fr recipe's training pairs, projected from the curve
MIB = 1 << 20


class Rehearsal:
    """One bench run: its options, work folder, machine facts and the records so far."""

    def __init__(self, opts: argparse.Namespace) -> None:
        self.opts, self.work = opts, opts.work.resolve()
        if self.work == REPO or REPO in self.work.parents:
            raise SystemExit(f"--work {self.work} is inside the repository; give a folder "
                             "outside it (the corpus is gigabytes)")
        from nmt.doctor import report

        self.doctor = report(measure=False)
        self.run = record.run_id()
        self.records: list[dict[str, Any]] = []
        self.env = {**os.environ, "PYTHONPATH": str(REPO)}

    # -- bookkeeping -------------------------------------------------------------------
    def note(self, pairs: int, stage: str, system: str, figures: dict[str, Any],
             note: str | None = None, **settings: Any) -> None:
        settings = {"recipe": "wmt14-en-de", "pairs": pairs, "stage": stage,
                    "smoke": self.opts.smoke, **settings}
        rec = record.make("wmt-rehearsal", system, settings, figures, self.doctor,
                          run=self.run, note=note)
        self.records.append(rec)
        print(json.dumps({"pairs": pairs, "stage": stage, "system": system, **figures}),
              flush=True)

    def stage(self, pairs: int, stage: str, command: list[str], system: str = "nmt",
              leaves: tuple[Path, ...] = (), stdout: Path | None = None,
              env: dict[str, str] | None = None, **extra: Any) -> Measured:
        """Run and record one stage; a failure stops the bench with its stderr's tail."""
        before = disk_bytes(*leaves) if leaves else 0
        measured = run_stage(command, cwd=self.work, env=env or self.env, stdout=stdout)
        if measured.returncode != 0:
            tail = "\n".join(line for _, line in measured.lines[-15:])
            raise SystemExit(f"{stage} at {pairs} pairs failed (exit "
                             f"{measured.returncode}): {' '.join(command)}\n{tail}")
        figures: dict[str, Any] = measured.figures()
        if leaves:
            figures["disk_mib"] = round((disk_bytes(*leaves) - before) / MIB, 1)
        self.note(pairs, stage, system, figures, **extra)
        return measured

    # -- the stages --------------------------------------------------------------------
    def size(self, pairs: int, full: bool) -> None:
        opts = self.opts
        archives, data = self.work / f"archives-{pairs}", self.work / f"data-{pairs}"
        shutil.rmtree(archives, ignore_errors=True)
        shutil.rmtree(data, ignore_errors=True)
        built = corpus.build_archives(archives, pairs, SHARED, seed=opts.seed)
        recipe = corpus.write_recipe(RECIPE, archives, archives / "wmt14-en-de.toml")
        self.note(pairs, "build", "nmt", {"wall_s": round(built.seconds, 2),
                                          "archive_mib": round(built.archive_bytes / MIB, 1),
                                          "text_mib": round(built.text_bytes / MIB, 1),
                                          "planted": built.planted},
                  note="the bench's own step (not a user's): the five archives made")
        self.stage(pairs, "prep", [*NMT, "prep", str(recipe), "-o", str(data), "--mirror",
                                   str(archives)], leaves=(data,))
        counts = json.loads((data / "manifest.json").read_text("utf-8"))[
            "splits"]["train"]["cleaning_counts"]["total"]
        text = [data / f"{split}.{side}" for split in ("train", "valid", "test")
                for side in ("src", "tgt")]
        self.records[-1]["figures"].update(
            pairs_out=counts["output"], cleaning=counts,
            extract_mib=round(disk_bytes(data / "raw") / MIB, 1),
            text_mib=round(disk_bytes(*text) / MIB, 1))
        bpe_cmd = [*NMT, "bpe", str(data)] + (["--vocab-size", str(opts.vocab_size)]
                                              if opts.vocab_size else [])
        bpe = self.stage(pairs, "bpe", bpe_cmd, leaves=(data,))
        trained = bpe.at("pieces trained")
        started = bpe.at("training joint BPE")
        if trained is not None and started is not None:
            self.records[-1]["figures"].update(vocab_s=round(trained - started, 2),
                                               encode_s=round(bpe.wall_s - trained, 2))
        if full:
            self.model_stages(pairs, data)
            if opts.peers:
                self.peers(pairs, data)
        if not opts.keep:
            shutil.rmtree(archives)
            if not full:
                shutil.rmtree(data)

    def model_stages(self, pairs: int, data: Path) -> None:
        opts = self.opts
        run = self.work / f"run-{pairs}"
        shutil.rmtree(run, ignore_errors=True)
        train = self.stage(pairs, "train", [
            *NMT, "train", str(data), "-o", str(run), "--arch", opts.arch,
            "--batch-tokens", str(opts.batch_tokens), "--max-updates", str(opts.updates),
            "--save-interval-updates", "1", "--log-interval", "1"], leaves=(run,),
            arch=opts.arch, batch_tokens=opts.batch_tokens, updates=opts.updates)
        loaded, first = train.at("training pairs in"), train.at("update 1 |")
        plan = next((line for _, line in train.lines if "training pairs in" in line), "")
        tokens = [int(a) + int(b) for a, b in re.findall(r"tok/update (\d+)\+(\d+)",
                                                        "\n".join(x for _, x in train.lines))]
        self.records[-1]["figures"].update(
            loader_s=loaded, first_update_s=first,
            s_per_update=round((train.wall_s - (first or 0)) / max(1, opts.updates - 1), 2),
            tokens_per_update=round(sum(tokens) / len(tokens)) if tokens else None)
        self.records[-1]["settings"]["plan"] = plan
        model = run / "average.pt"
        self.stage(pairs, "average", [*NMT, "average", str(run), "--last",
                                      str(min(3, opts.updates)), "-o", str(model)],
                   leaves=(model,))
        hyp = run / "test.hyp"
        translate = self.stage(pairs, "translate", [
            *NMT, "translate", "-m", str(model), "-i", str(data / "test.src"), "-o",
            str(hyp)], leaves=(hyp,))
        lines = hyp.read_text("utf-8").count("\n")
        self.records[-1]["figures"].update(lines=lines, sentences_per_s=round(
            lines / translate.wall_s, 2))
        for stage, extra in (("score-paper", ["--paper"]), ("score-sacrebleu", [])):
            out = run / f"{stage}.json"
            self.stage(pairs, stage, [*NMT, "score", "--ref", str(data / "test.tgt"), "-i",
                                      str(hyp), "--json", *extra], stdout=out)
            score = json.loads(out.read_text("utf-8"))["scores"][0]
            self.records[-1]["figures"]["bleu"] = round(score["score"], 2)
            self.records[-1]["settings"]["signature"] = score["signature"]

    def peers(self, pairs: int, data: Path) -> None:
        """sentencepiece's own trainer, then fairseq's path, on the text nmt just used."""
        from nmt.data.bpe import BpeConfig
        from nmt.data.vocab import BOS_ID, EOS_ID, NORMALIZATION, PAD_ID, UNK_ID

        meta = json.loads((data / "bin" / "meta.json").read_text("utf-8"))
        peer = self.work / f"peers-{pairs}"
        shutil.rmtree(peer, ignore_errors=True)
        peer.mkdir()
        sample = BpeConfig().sample
        # The options of nmt.data.vocab.train_vocab; sentencepiece samples by itself.
        options = dict(input=f"{data}/train.src,{data}/train.tgt", model_type="bpe",
                       vocab_size=meta["vocab_size"], pad_id=PAD_ID, unk_id=UNK_ID,
                       bos_id=BOS_ID, eos_id=EOS_ID, character_coverage=1.0,
                       byte_fallback=True, normalization_rule_name=NORMALIZATION,
                       num_threads=2, minloglevel=2, input_sentence_size=sample,
                       shuffle_input_sentence=True, model_prefix=str(peer / "spm"))
        script = ("import sentencepiece as spm, sys, json; "
                  "spm.SentencePieceTrainer.train(**json.loads(sys.argv[1]))")
        self.stage(pairs, "vocab", [sys.executable, "-c", script, json.dumps(options)],
                   system="sentencepiece", leaves=(peer,), sample=sample,
                   vocab_size=meta["vocab_size"])
        # fairseq's path: the pieces as text (its examples' spm_encode), then binarize.
        encode = ("import sentencepiece as spm, sys\n"
                  "sp = spm.SentencePieceProcessor(model_file=sys.argv[1])\n"
                  "for path, out in zip(sys.argv[2::2], sys.argv[3::2]):\n"
                  "    with open(path, encoding='utf-8') as f, open(out, 'w', "
                  "encoding='utf-8') as g:\n"
                  "        while chunk := f.readlines(1 << 24):\n"
                  "            for p in sp.encode([l.rstrip('\\n') for l in chunk], "
                  "out_type=str, num_threads=2):\n"
                  "                g.write(' '.join(p) + '\\n')\n")
        files = [str(x) for split in ("train", "valid", "test") for side in ("src", "tgt")
                 for x in (data / f"{split}.{side}", peer / f"{split}.{side}")]
        self.stage(pairs, "encode-pieces", [sys.executable, "-c", encode,
                                            str(data / "spm.model"), *files],
                   system="sentencepiece", leaves=(peer,))
        bin_dir = ensure_venv()
        write_dict(data / "spm.model", peer / "dict.txt")
        self.stage(pairs, "binarize", [
            str(bin_dir / "fairseq-preprocess"), "--source-lang", "src", "--target-lang",
            "tgt", "--trainpref", str(peer / "train"), "--validpref", str(peer / "valid"),
            "--testpref", str(peer / "test"), "--destdir", str(peer / "bin"),
            "--srcdict", str(peer / "dict.txt"), "--tgtdict", str(peer / "dict.txt"),
            "--workers", "2", "--dataset-impl", "mmap"], system="fairseq",
            leaves=(peer / "bin",), env=FAIRSEQ_ENV, workers=2)
        if not self.opts.keep:
            shutil.rmtree(peer)


def parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pairs", default="500000,1000000,2000000,4500000",
                        help="training pairs of each size, comma-separated")
    parser.add_argument("--work", type=Path, default=Path(os.environ.get(
        "TMPDIR", "/tmp")) / "nmt-wmt-rehearsal", help="folder for archives, data, runs "
        "(outside the repository; about 6 GB at 4.5M pairs)")
    parser.add_argument("--updates", type=int, default=5, help="base updates trained")
    parser.add_argument("--arch", default="base")
    parser.add_argument("--batch-tokens", type=int, default=25000)
    parser.add_argument("--vocab-size", type=int, default=0, help="0: the recipe's 37,000")
    parser.add_argument("--no-peers", dest="peers", action="store_false")
    parser.add_argument("--keep", action="store_true", help="keep every size's files")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--smoke", action="store_true",
                        help="3,000 pairs, a tiny model, 1,000 pieces, no peers: the test")
    record.add_argument(parser, "wmt-rehearsal")
    opts = parser.parse_args(argv)
    if opts.smoke:
        opts.pairs, opts.arch, opts.batch_tokens, opts.updates = "3000", "tiny", 2000, 2
        opts.vocab_size, opts.peers = opts.vocab_size or 1000, False
    opts.sizes = sorted(int(p) for p in opts.pairs.split(","))
    return opts


def main(argv: list[str] | None = None) -> None:
    opts = parse(argv)
    bench = Rehearsal(opts)
    bench.work.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    for pairs in opts.sizes:
        bench.size(pairs, full=pairs == opts.sizes[-1])
        record.write(bench.records, opts.record)  # each size's as it ends: hours in all
        bench.records = []
    print(f"rehearsal done in {(time.perf_counter() - start) / 60:.1f} min", file=sys.stderr)


if __name__ == "__main__":
    main()
