"""Self-contained checkpoints: atomic writes and loading that never runs code.

A checkpoint is a dict saved with `torch.save` and read with `torch.load(weights_only=True)`,
so a crafted pickle cannot execute anything. Required keys: `format`, `step`, `model_config`
(ModelConfig.to_dict()), `vocab` (sentencepiece model bytes) and `model` (state dict). Training
checkpoints add `optimizer`, `scheduler`, `scaler`, `rng`, `data_state`, `train_config`.
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any, BinaryIO

import torch

from nmt.errors import CheckpointError, DataError, UsageError
from nmt.fileio import atomic_write_bytes

FORMAT = "nmt-checkpoint-v1"
# File names inside a run directory: the newest checkpoint, and the best validated model.
LAST = "checkpoint_last.pt"
BEST = "checkpoint_best.pt"
REQUIRED_KEYS = ("format", "step", "model_config", "vocab", "model")


class _WriteErrors:
    """A binary file wrapper that remembers the OSError of a failed `write`.

    torch.save's zip writer turns a failed write (ENOSPC, EFBIG, EIO) into a RuntimeError
    ("unexpected pos ...") that loses the cause; keeping it lets a full disk be reported as
    a full disk (CheckpointError, exit 6) instead of crashing with a traceback.
    """

    def __init__(self, handle: BinaryIO) -> None:
        self.handle = handle
        self.error: OSError | None = None

    def write(self, data: bytes) -> int:
        """Forward to the file; remember (and re-raise) an OSError."""
        try:
            return self.handle.write(data)
        except OSError as err:
            self.error = self.error or err
            raise

    def flush(self) -> None:
        """Forward to the file; remember (and re-raise) an OSError."""
        try:
            self.handle.flush()
        except OSError as err:
            self.error = self.error or err
            raise


def _torch_save(payload: dict[str, Any], handle: BinaryIO) -> None:
    """torch.save into `handle`, raising the underlying OSError when a write failed."""
    wrapped = _WriteErrors(handle)
    try:
        torch.save(payload, wrapped)
    except RuntimeError as err:
        cause: BaseException | None = wrapped.error or err.__context__
        if isinstance(cause, OSError):
            raise cause from err
        raise


def save_checkpoint(payload: dict[str, Any], path: Path) -> None:
    """Write `payload` atomically; raises CheckpointError (disk full, no permission)."""
    missing = [k for k in REQUIRED_KEYS if k not in payload]
    if missing:
        raise ValueError(f"checkpoint payload lacks {missing}")
    try:
        atomic_write_bytes(Path(path), lambda handle: _torch_save(payload, handle))
    except OSError as err:
        raise CheckpointError(f"{path}: cannot write checkpoint ({err.strerror or err}); "
                              "free disk space or fix permissions, the previous checkpoint "
                              "is intact") from err


def load_checkpoint(path: Path, map_location: str | torch.device = "cpu",
                    mmap: bool = False) -> dict[str, Any]:
    """Load a checkpoint safely (weights_only) and check its format and keys.

    `mmap=True` maps tensor storages lazily instead of reading them (cheap metadata scans).
    """
    path = Path(path)
    if not path.is_file():
        raise DataError(f"{path}: no such checkpoint file")
    try:
        with warnings.catch_warnings():  # e.g. "pickle protocol 4": the error says enough
            warnings.simplefilter("ignore")
            payload = torch.load(path, map_location=map_location, weights_only=True,
                                 mmap=mmap)
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


WEIGHTS: tuple[str, ...] = ("auto", "raw", "ema")


def model_state(payload: dict[str, Any], weights: str = "auto",
                path: Path | None = None) -> dict[str, torch.Tensor]:
    """The state dict a checkpoint offers for `weights`: `raw`, `ema` (the averaged
    parameters of `--ema-decay` over the raw buffers) or `auto` (ema where the file has
    it, else raw)."""
    if weights not in WEIGHTS:
        raise UsageError(f"unknown weights {weights!r}; choose one of: {', '.join(WEIGHTS)}")
    ema = payload.get("ema")
    if weights == "raw" or (weights == "auto" and not ema):
        return payload["model"]
    if not ema:
        raise CheckpointError(f"{path or 'checkpoint'}: holds no EMA weights (train with "
                              "--ema-decay); use --weights raw")
    return {**payload["model"], **ema["weights"]}


def stored_step(path: Path) -> int:
    """The step saved inside a checkpoint, read memory-mapped: only the small pickled
    header is read, not the weights and optimizer state (tens of GB for big)."""
    step = load_checkpoint(path, mmap=True)["step"]
    if not isinstance(step, int):
        raise CheckpointError(f"{path}: stored step is not an integer ({step!r})")
    return step


def load_model(path: Path, device: str | torch.device = "cpu",
               weights: str = "auto") -> tuple[Any, Any, dict]:
    """Rebuild (model in eval mode, Vocab, payload) from a checkpoint alone, with its
    `weights` (see `model_state`: the EMA weights where it has them, by default)."""
    from nmt.config import ModelConfig
    from nmt.model import Transformer
    from nmt.vocab import Vocab

    payload = load_checkpoint(path)
    state = model_state(payload, weights, path)
    try:
        config = ModelConfig.from_dict(payload["model_config"])
        model = Transformer(config)
        model.load_state_dict(state)
    except Exception as err:
        raise CheckpointError(f"{path}: checkpoint does not fit the model ({err})") from err
    vocab = Vocab(payload["vocab"])
    return model.to(device).eval(), vocab, payload
