"""Helpers for translate/average tests: a tiny, random-init but real checkpoint.

The vocabulary is a real sentencepiece BPE model trained on the first Multi30k training
lines; the model is `Transformer(tiny)` with a fixed seed, saved with save_checkpoint and
the standard payload keys, so it loads through the same path as a trained model.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import torch

from nmt.checkpoint import model_payload, save_checkpoint
from nmt.config import model_preset
from nmt.data.vocab import train_vocab
from nmt.model.transformer import Transformer

REPO = Path(__file__).resolve().parents[1]
NMT = [sys.executable, "-m", "cli.main"]



def make_vocab(multi30k: Path, workdir: Path, lines: int = 1500, size: int = 600) -> Path:
    """Train a joint BPE model on the first `lines` of Multi30k train.en + train.de."""
    workdir.mkdir(parents=True, exist_ok=True)
    inputs = []
    for lang in ("en", "de"):
        text = (multi30k / f"train.{lang}").read_text(encoding="utf-8").split("\n")[:lines]
        path = workdir / f"head.{lang}"
        path.write_text("\n".join(text) + "\n", encoding="utf-8")
        inputs.append(path)
    model = workdir / "spm.model"
    train_vocab(inputs, model, size, threads=1)
    return model


def make_checkpoint(spm_model: Path, path: Path, seed: int = 0, step: int = 100,
                    max_positions: int = 128, **overrides: object) -> Path:
    """Save a random-init tiny Transformer with the vocabulary; returns `path`."""
    proto = spm_model.read_bytes()
    from nmt.data.vocab import Vocab

    cfg = model_preset("tiny", vocab_size=len(Vocab(proto)), max_positions=max_positions,
                       **overrides)
    torch.manual_seed(seed)
    model = Transformer(cfg)
    # Random init gives near-uniform outputs; sharpen them so that the search is decisive
    # and the output depends clearly on the input.
    with torch.no_grad():
        model.embed.weight.mul_(4.0)
    payload = model_payload(step=step, model_config=cfg.to_dict(), vocab=proto,
                            model=model.state_dict(),
                            meta={"src_lang": "en", "tgt_lang": "de", "data_dir": "test"})
    save_checkpoint(payload, path)
    return path


def cli_nmt(*args: str, input: bytes | None = None) -> subprocess.CompletedProcess[bytes]:
    """Run the CLI in process (fast: no interpreter start); same result shape as run_nmt."""
    from typer.testing import CliRunner

    from cli.main import app

    result = CliRunner().invoke(app, list(args), input=input)
    if result.exception is not None and not isinstance(result.exception, SystemExit):
        raise result.exception
    return subprocess.CompletedProcess(list(args), result.exit_code, result.stdout_bytes,
                                       result.stderr_bytes)


def run_nmt(*args: str, input: bytes | None = None, timeout: float = 300,
            ) -> subprocess.CompletedProcess[bytes]:
    """Run the real CLI in a subprocess (real pipes, real stdin/stdout bytes)."""
    env = dict(os.environ, PYTHONIOENCODING="utf-8", OMP_NUM_THREADS="1")
    return subprocess.run([*NMT, *args], input=input, capture_output=True, cwd=REPO,
                          env=env, timeout=timeout, check=False)
