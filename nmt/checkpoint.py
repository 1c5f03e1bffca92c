"""Self-contained checkpoints: atomic writes and loading that never runs code.

A checkpoint is a dict saved with `torch.save` and read with `torch.load(weights_only=True)`,
so a crafted pickle cannot execute anything. Required keys: `format`, `step`, `model_config`
(ModelConfig.to_dict()), `vocab` (sentencepiece model bytes) and `model` (state dict). Training
checkpoints add `optimizer`, `scheduler`, `scaler`, `rng`, `data_state`, `train_config`.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Any

import torch

from nmt.errors import CheckpointError, DataError

FORMAT = "nmt-checkpoint-v1"
REQUIRED_KEYS = ("format", "step", "model_config", "vocab", "model")


def atomic_write_bytes(path: Path, write: Any) -> None:
    """Call `write(fileobj)` on a temp file beside `path`, fsync, then rename over `path`.

    Readers see either the old file or the complete new one, never a partial write; on
    any error the temp file is removed and the old file is untouched.
    """
    path = Path(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as handle:
            write(handle)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    dir_fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


def save_checkpoint(payload: dict[str, Any], path: Path) -> None:
    """Write `payload` atomically; raises CheckpointError (disk full, no permission)."""
    missing = [k for k in REQUIRED_KEYS if k not in payload]
    if missing:
        raise ValueError(f"checkpoint payload lacks {missing}")
    try:
        atomic_write_bytes(Path(path), lambda handle: torch.save(payload, handle))
    except OSError as err:
        raise CheckpointError(f"{path}: cannot write checkpoint ({err.strerror or err}); "
                              "free disk space or fix permissions, the previous checkpoint "
                              "is intact") from err


def load_checkpoint(path: Path, map_location: str | torch.device = "cpu") -> dict[str, Any]:
    """Load a checkpoint safely (weights_only) and check its format and keys."""
    path = Path(path)
    if not path.is_file():
        raise DataError(f"{path}: no such checkpoint file")
    try:
        payload = torch.load(path, map_location=map_location, weights_only=True)
    except Exception as err:  # UnpicklingError, RuntimeError (zip), EOFError, ...
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise CheckpointError(f"{path}: refused to load: not a safe nmt checkpoint "
                              f"({first[:200]})") from err
    if not isinstance(payload, dict) or payload.get("format") != FORMAT:
        raise CheckpointError(f"{path}: not an nmt checkpoint (format {FORMAT} expected)")
    missing = [k for k in REQUIRED_KEYS if k not in payload]
    if missing:
        raise CheckpointError(f"{path}: checkpoint lacks {', '.join(missing)}")
    return payload


def load_model(path: Path, device: str | torch.device = "cpu") -> tuple[Any, Any, dict]:
    """Rebuild (model in eval mode, Vocab, payload) from a checkpoint alone."""
    from nmt.config import ModelConfig
    from nmt.model import Transformer
    from nmt.vocab import Vocab

    payload = load_checkpoint(path)
    try:
        config = ModelConfig.from_dict(payload["model_config"])
        model = Transformer(config)
        model.load_state_dict(payload["model"])
    except Exception as err:
        raise CheckpointError(f"{path}: checkpoint does not fit the model ({err})") from err
    vocab = Vocab(payload["vocab"])
    return model.to(device).eval(), vocab, payload
