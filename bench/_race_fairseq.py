"""The fairseq side of bench/race_multi30k.py: venv, data, training command, decoding.

fairseq (`fairseq-fixed` 0.12 from PyPI) lives in its own virtual environment,
bench/.venv-fairseq, and is only ever run as a subprocess (its console scripts), so the two
toolkits never share an interpreter. It gets exactly nmt's data and vocabulary: every split
is encoded to sentencepiece piece text with nmt's DATA/spm.model, and fairseq-preprocess
binarizes it with --joined-dictionary --srcdict built from the same spm vocabulary (fairseq's
own four specials <s> <pad> </s> <unk> replace spm's four, so both vocabularies have the
same size and pieces).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import sentencepiece as spm

REPO = Path(__file__).resolve().parents[1]
VENV = REPO / "bench" / ".venv-fairseq"
SPLITS = ("train", "valid", "test")
# fairseq 0.12 pickles its config into checkpoints; torch >= 2.6 refuses that by default.
ENV = {**os.environ, "TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD": "1", "PYTHONWARNINGS": "ignore"}


def ensure_venv(venv: Path = VENV) -> Path:
    """bench/.venv-fairseq with fairseq-fixed and the project's torch; created if missing.
    Returns the venv's bin folder."""
    bin_dir = venv / "bin"
    if (bin_dir / "fairseq-train").exists():
        return bin_dir
    print(f"creating {venv} (fairseq-fixed + torch 2.13.0); this takes a few minutes",
          file=sys.stderr)
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    subprocess.run([str(bin_dir / "pip"), "install", "-q", "-c",
                    str(REPO / "bench" / "constraints.txt"), "torch==2.13.0", "fairseq-fixed"],
                   check=True)
    return bin_dir


def write_pieces(spm_model: Path, src: Path, dst: Path, limit: int | None) -> None:
    """Encode `src` lines to space-separated sentencepiece pieces in `dst`."""
    sp = spm.SentencePieceProcessor(model_file=str(spm_model))
    lines = src.read_text(encoding="utf-8").splitlines()[:limit]
    pieces = sp.encode(lines, out_type=str)
    dst.write_text("".join(" ".join(p) + "\n" for p in pieces), encoding="utf-8")


def write_dict(spm_model: Path, dst: Path) -> int:
    """fairseq dict.txt ("piece count" lines) with spm's pieces after its 4 specials, in spm
    order; returns the number of pieces written."""
    sp = spm.SentencePieceProcessor(model_file=str(spm_model))
    # Rank-based counts keep fairseq from re-sorting; they are never used for anything else.
    pieces = [sp.id_to_piece(i) for i in range(4, sp.get_piece_size())]
    dst.write_text("".join(f"{p} {len(pieces) - i}\n" for i, p in enumerate(pieces)),
                   encoding="utf-8")
    return len(pieces)


def prepare(data_dir: Path, work: Path, src_lang: str, tgt_lang: str, bin_dir: Path,
            test_lines: int | None) -> Path:
    """Piece text + fairseq-preprocess of DATA's train/valid/test; returns the binarized
    folder (skipped when it is already there)."""
    dest = work / "bin"
    if (dest / "dict.txt").exists() or (dest / f"dict.{src_lang}.txt").exists():
        return dest
    text = work / "text"
    text.mkdir(parents=True, exist_ok=True)
    spm_model = data_dir / "spm.model"
    for split in SPLITS:
        limit = test_lines if split == "test" else None
        write_pieces(spm_model, data_dir / f"{split}.src", text / f"{split}.{src_lang}", limit)
        write_pieces(spm_model, data_dir / f"{split}.tgt", text / f"{split}.{tgt_lang}", limit)
    write_dict(spm_model, work / "dict.txt")
    with (work / "preprocess.log").open("w", encoding="utf-8") as log:
        subprocess.run([str(bin_dir / "fairseq-preprocess"), "--source-lang", src_lang,
                        "--target-lang", tgt_lang, "--trainpref", str(text / "train"),
                        "--validpref", str(text / "valid"), "--testpref", str(text / "test"),
                        "--destdir", str(dest), "--joined-dictionary",
                        "--srcdict", str(work / "dict.txt"), "--workers", "2"],
                       check=True, env=ENV, stdout=log, stderr=subprocess.STDOUT)
    return dest


SCHEDULES = ("inverse_sqrt", "linear")


def schedule_flags(schedule: str, lr: float, total_updates: int | None) -> list[str]:
    """fairseq-train's learning-rate flags: linear warm-up from 1e-7 over 400 updates to
    `lr`, then `inverse_sqrt` (the paper's decay) or `linear` (`polynomial_decay` with power
    1 down to 0 at update `total_updates`: fairseq's budgeted schedule; it counts updates,
    not minutes, so the race sets `total_updates` to what fairseq makes in the budget)."""
    if schedule == "inverse_sqrt":
        return ["--lr", str(lr), "--lr-scheduler", "inverse_sqrt",
                "--warmup-updates", "400", "--warmup-init-lr", "1e-7"]
    if schedule == "linear":
        if not total_updates:
            sys.exit("race: the fairseq linear schedule needs --fairseq-total-updates")
        return ["--lr", str(lr), "--lr-scheduler", "polynomial_decay", "--power", "1",
                "--warmup-updates", "400", "--end-learning-rate", "0",
                "--total-num-update", str(total_updates)]
    sys.exit(f"race: unknown fairseq schedule {schedule!r}; choose among {SCHEDULES}")


def train_command(bin_dir: Path, data_bin: Path, save_dir: Path, minutes: float,
                  save_updates: int, extra: list[str], schedule: list[str] | None = None
                  ) -> list[str]:
    """fairseq-train for the `small` shape (3+3 layers, 256/1024, 4 heads, shared
    embeddings, post-norm, sinusoidal positions) with the race's common recipe.

    nmt's Multi30k optimisation in fairseq's terms: Adam (0.9, 0.98), 400 warm-up updates,
    label_smoothed_cross_entropy with 0.1, dropout 0.1, max-tokens 2048; the learning-rate
    flags `schedule` (`schedule_flags`; default inverse_sqrt to a 1.25e-3 peak). fairseq's
    own IWSLT recipe (lr 5e-4, warmup 4000, dropout 0.3) is tuned for ~50 epochs, far more
    than a CPU budget of minutes.
    --num-workers 0: on 2 cores a loader process only competes with training.
    Validation is off (it would eat the budget; nmt's is off too); checkpoints are written
    every `save_updates` updates and at each epoch end (fairseq has no time-based saving),
    and the race picks the last one written before each budget mark by its file time.
    """
    return [str(bin_dir / "fairseq-train"), str(data_bin), "--cpu", "--seed", "1",
            "--arch", "transformer", "--share-all-embeddings",
            "--encoder-layers", "3", "--decoder-layers", "3",
            "--encoder-embed-dim", "256", "--decoder-embed-dim", "256",
            "--encoder-ffn-embed-dim", "1024", "--decoder-ffn-embed-dim", "1024",
            "--encoder-attention-heads", "4", "--decoder-attention-heads", "4",
            "--dropout", "0.1", "--optimizer", "adam", "--adam-betas", "(0.9, 0.98)",
            *(schedule or schedule_flags("inverse_sqrt", 1.25e-3, None)),
            "--criterion", "label_smoothed_cross_entropy", "--label-smoothing", "0.1",
            "--max-tokens", "2048", "--num-workers", "0", "--disable-validation",
            "--save-dir", str(save_dir), "--save-interval-updates", str(save_updates),
            "--keep-interval-updates", "-1", "--stop-time-hours", f"{minutes / 60:.6f}",
            "--log-format", "simple", "--log-interval", "50", *extra]


_NAME = re.compile(r"checkpoint(\d+)\.pt$|checkpoint_(\d+)_(\d+)\.pt$|checkpoint_last\.pt$")


def checkpoints(save_dir: Path) -> list[Path]:
    """Checkpoints oldest first by file time: epoch-end `checkpointE.pt`, mid-epoch
    `checkpoint_E_U.pt`, and checkpoint_last.pt (the save at --stop-time-hours goes only
    there when it falls on neither an interval nor an epoch end; earlier versions of it
    were copies of numbered files, so judging it by its final file time loses nothing)."""
    found = [p for p in save_dir.glob("checkpoint*.pt") if _NAME.search(p.name)]
    return sorted(found, key=lambda p: p.stat().st_mtime)


def num_updates(bin_dir: Path, paths: list[Path]) -> list[int]:
    """The update count stored inside each fairseq checkpoint (read in fairseq's venv)."""
    code = ("import sys, torch\n"
            "for p in sys.argv[1:]:\n"
            "    s = torch.load(p, map_location='cpu', weights_only=False)\n"
            "    print(s['optimizer_history'][-1]['num_updates'])\n")
    out = subprocess.run([str(bin_dir / "python"), "-c", code, *map(str, paths)], check=True,
                         env=ENV, capture_output=True, text=True).stdout
    return [int(x) for x in out.split()]


def generate(bin_dir: Path, data_bin: Path, checkpoint: Path, spm_model: Path, beam: int,
             lenpen: float, max_len_b: int, log: Path) -> list[str]:
    """fairseq-generate on the test split (beam, lenpen, max length 0 * src + b), H lines
    sorted by sentence id, spm-decoded to detokenized text."""
    out = subprocess.run([str(bin_dir / "fairseq-generate"), str(data_bin), "--cpu",
                          "--path", str(checkpoint), "--gen-subset", "test",
                          "--beam", str(beam), "--lenpen", str(lenpen), "--max-len-a", "0",
                          "--max-len-b", str(max_len_b), "--max-tokens", "8192"],
                         check=True, env=ENV, capture_output=True, text=True)
    log.write_text(out.stderr, encoding="utf-8")
    hyps: dict[int, str] = {}
    for line in out.stdout.splitlines():
        if line.startswith("H-"):
            ident, _score, *text = line.split("\t")
            hyps[int(ident[2:])] = text[0] if text else ""
    sp = spm.SentencePieceProcessor(model_file=str(spm_model))
    return [sp.decode_pieces(hyps[i].split()) for i in range(len(hyps))]
