"""What the exporters share: reading the checkpoint once, the output directory written
under a temporary name and renamed when complete, and the model card's account of what
the model is and how it was trained (from the checkpoint's stored configs and the data
manifest `nmt prep` wrote)."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from nmt.errors import DataError, UsageError


@dataclass
class Exported:
    """A checkpoint read for export: the float32 model in eval mode, its vocabulary and
    the payload it came from."""

    path: Path
    model: Any  # nmt.model.transformer.Transformer
    vocab: Any  # nmt.data.vocab.Vocab
    payload: dict[str, Any]


def read_checkpoint(checkpoint: Path, weights: str = "auto") -> Exported:
    """Load `checkpoint` for export (CPU, float32, eval; its EMA weights where it has them
    unless `weights` says otherwise)."""
    from nmt.checkpoint import load_model

    model, vocab, payload = load_model(Path(checkpoint), "cpu", weights)
    return Exported(Path(checkpoint), model.float().eval(), vocab, payload)


def check_output(output: Path, force: bool) -> Path:
    """`output` may be written: absent, or present with `force`; its parent exists."""
    output = Path(output)
    if output.exists() and not force:
        raise UsageError(f"{output} already exists; pass --force to replace it")
    parent = output.absolute().parent
    if not parent.is_dir():
        raise DataError(f"{parent}: no such directory; create it first")
    return output


@contextlib.contextmanager
def temp_dir(parent: Path, name: str) -> Iterator[Path]:
    """A temporary directory beside the output (same file system: rename is atomic),
    removed afterwards whatever happens."""
    try:
        tmp = Path(tempfile.mkdtemp(prefix=f".{name}.", dir=parent))
    except OSError as err:
        raise DataError(f"{parent}: cannot write there ({err.strerror or err})") from err
    try:
        yield tmp
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def replace_dir(new: Path, output: Path, tmp: Path) -> None:
    """Rename the finished `new` directory to `output`; an existing `output` (allowed by
    --force) is first moved into `tmp`, to be removed with it."""
    try:
        if output.exists():
            os.replace(output, tmp / "old")
        os.replace(new, output)
    except OSError as err:
        raise DataError(f"{output}: cannot write the model directory "
                        f"({err.strerror or err})") from err


def architecture(model: Any) -> str:
    """One line: layers, widths, heads, norm placement, positions."""
    cfg = model.config
    return (f"Transformer, {cfg.encoder_layers}+{cfg.decoder_layers} layers, d_model "
            f"{cfg.d_model}, d_ff {cfg.d_ff}, {cfg.heads} heads, "
            f"{'pre' if cfg.pre_norm else 'post'}-norm, "
            f"{'learned' if cfg.learned_positions else 'sinusoidal'} positions, "
            f"{sum(p.numel() for p in model.parameters()):,} parameters")


def language_pair(exported: Exported) -> tuple[str, str]:
    """(source, target) codes from the checkpoint, else from its data's manifest, else
    ("", "")."""
    meta = exported.payload.get("meta") or {}
    if meta.get("src_lang") and meta.get("tgt_lang"):
        return str(meta["src_lang"]), str(meta["tgt_lang"])
    manifest = _manifest(meta.get("data_dir")) or {}
    return str(manifest.get("src_lang") or ""), str(manifest.get("tgt_lang") or "")


def training_story(exported: Exported) -> list[str]:
    """Markdown lines on how the model was made: language pair, data (recipe, sizes from
    the manifest when it is still there), training settings, updates, averaging."""
    payload = exported.payload
    meta = payload.get("meta") or {}
    lines = [f"- Model: {architecture(exported.model)}; vocabulary "
             f"{len(exported.vocab):,} joint sentencepiece BPE pieces."]
    source, target = language_pair(exported)
    lines.append(f"- Languages: {source or '?'} -> {target or '?'}.")
    manifest = _manifest(meta.get("data_dir"))
    if manifest:
        train = (manifest.get("splits") or {}).get("train") or {}
        sizes = f", {train['lines']:,} training pairs" if "lines" in train else ""
        lines.append(f"- Data: `nmt prep` recipe {manifest.get('recipe', '?')}{sizes}.")
    elif meta.get("data_dir"):
        lines.append(f"- Data: {meta['data_dir']} (its manifest is not at hand).")
    train_config = payload.get("train_config") or meta.get("train_config")
    if isinstance(train_config, dict):
        keys = ("max_tokens", "update_freq", "batch_tokens", "warmup", "lr_scale",
                "label_smoothing", "precision", "ema_decay")
        settings = ", ".join(f"{k} {train_config[k]}" for k in keys if k in train_config)
        lines.append(f"- Training: {payload.get('step', '?')} updates; {settings}.")
    else:
        lines.append(f"- Training: {payload.get('step', '?')} updates.")
    if meta.get("averaged_from"):
        steps = ", ".join(str(item.get("step")) for item in meta["averaged_from"])
        lines.append(f"- Weights: the average of the checkpoints at updates {steps} "
                     f"({meta.get('averaged_weights', 'raw')} weights).")
    return lines


def _manifest(data_dir: Any) -> dict[str, Any] | None:
    if not data_dir:
        return None
    try:
        manifest = json.loads((Path(data_dir) / "manifest.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return manifest if isinstance(manifest, dict) else None
