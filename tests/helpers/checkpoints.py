"""Checkpoints for the translate/average/export tests: a tiny, random-init but real one,
and a pickle that runs code when loaded (what a hostile checkpoint ships).

The vocabulary is a real sentencepiece BPE model trained on the first Multi30k training
lines; the model is `Transformer(tiny)` with a fixed seed, saved with save_checkpoint and
the standard payload keys, so it loads through the same path as a trained model.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from nmt.checkpoint import model_payload, save_checkpoint
from nmt.config import model_preset
from nmt.data.vocab import train_vocab
from nmt.model.transformer import Transformer


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


class RunsCode:
    """Unpickling this calls os.system(command): what an attacker would ship."""

    def __init__(self, command: str) -> None:
        self.command = command

    def __reduce__(self) -> tuple:
        return (os.system, (self.command,))
