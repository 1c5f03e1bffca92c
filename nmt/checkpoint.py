"""Self-contained checkpoints: atomic writes and loading that never runs code.

A checkpoint is a dict saved with `torch.save` and read with `torch.load(weights_only=True)`,
so a crafted pickle cannot execute anything. Required keys: `format`, `step`, `model_config`
(ModelConfig.to_dict()), `vocab` (sentencepiece model bytes) and `model` (state dict). Training
checkpoints add `optimizer`, `scheduler`, `scaler`, `rng`, `data_state`, `train_config`.
"""

from __future__ import annotations

import warnings
import zipfile
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, BinaryIO

import torch

from nmt.config import WEIGHTS
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


def model_payload(*, step: int, model_config: dict[str, Any], vocab: bytes,
                  model: dict[str, torch.Tensor], meta: dict[str, Any] | None = None,
                  **extra: Any) -> dict[str, Any]:
    """A checkpoint's payload: what every nmt model file holds (REQUIRED_KEYS and its
    meta), plus `extra` (a training checkpoint's optimizer, schedule, RNG and data state).
    The one place a payload is put together: training, the best model, averaging and the
    benches all call it."""
    clash = extra.keys() & {*REQUIRED_KEYS, "meta"}
    if clash:
        raise ValueError(f"extra payload keys {sorted(clash)} would replace required ones")
    return {"format": FORMAT, "step": int(step), "model_config": model_config, "vocab": vocab,
            "model": model, "meta": dict(meta or {}), **extra}


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


# What `-m RUN_DIR` means, in order of preference: the averaged model `nmt average` writes
# (the paper's final model), else the best validated checkpoint, else the latest one.
RUN_MODEL_FILES: tuple[str, ...] = ("average.pt", "checkpoint_best.pt", "checkpoint_last.pt")


def resolve_model_path(path: Path) -> tuple[Path, bool]:
    """The checkpoint file `path` names: itself when it is a file, or, for a run directory,
    its first RUN_MODEL_FILES entry that exists. Returns (file, whether a directory was
    resolved) so a caller can say which file it chose; DataError when a directory holds
    none of them."""
    path = Path(path)
    if not path.is_dir():
        return path, False
    for name in RUN_MODEL_FILES:
        if (path / name).is_file():
            return path / name, True
    raise DataError(f"{path}: a directory with no model in it (looked for "
                    f"{', '.join(RUN_MODEL_FILES)}); pass a checkpoint file or a run directory")


def resolve_model_paths(paths: Sequence[Path], say: Callable[[Path, Path], object]
                        ) -> list[Path]:
    """The checkpoint file of each path (`resolve_model_path`); `say(given, chosen)` is
    called for every run directory resolved, so the caller can tell the user which file."""
    files = []
    for path in paths:
        file, resolved = resolve_model_path(Path(path))
        if resolved:
            say(Path(path), file)
        files.append(file)
    return files


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
        raise CheckpointError(f"{path}: {_load_failure(err)}") from err
    if not isinstance(payload, dict) or payload.get("format") != FORMAT:
        raise CheckpointError(f"{path}: not an nmt checkpoint (format {FORMAT} expected)")
    missing = [k for k in REQUIRED_KEYS if k not in payload]
    if missing:
        raise CheckpointError(f"{path}: checkpoint lacks {', '.join(missing)}")
    return payload


def _load_failure(err: Exception) -> str:
    """What a failed torch.load means for the user, in one whole sentence.

    A pickle that weights_only refuses ("Weights only load failed"): not a safe nmt
    checkpoint. torch's zip reader on a cut or damaged file ("PytorchStreamReader failed
    reading zip archive: failed finding central directory. This is an internal miniz
    error...", a hint that shortening would end mid-sentence), an empty file (EOFError)
    or a cut inside the last record (a negative seek): truncated or corrupt. A file that
    is not a zip, read memory-mapped (a resume): refused, not ours. Anything else (a text
    file: "invalid load key"): not a readable checkpoint, with the error's first sentence.
    """
    text = str(err)
    if "weights only load failed" in text.lower():
        return ("refused to load: not a safe nmt checkpoint (it holds objects other than "
                "tensors and plain data)")
    if "mmap can only be used" in text:  # not a zip: a bare pickle or any other file
        return ("refused to load: not torch's zip format, which nmt always writes (a bare "
                "pickle or another kind of file)")
    if isinstance(err, EOFError | zipfile.BadZipFile) or any(
            marker in text for marker in ("PytorchStreamReader", "zip archive",
                                          "central directory", "negative seek")):
        return ("truncated or corrupt checkpoint (an interrupted copy or a full disk?); "
                "copy it again or use another checkpoint of the run")
    first = text.strip().splitlines()[0].split(". ")[0][:120] if text.strip() else ""
    return (f"not a readable nmt checkpoint ({type(err).__name__}"
            f"{': ' + first if first else ''})")


def model_state(payload: dict[str, Any], weights: str = "auto",
                path: Path | None = None) -> dict[str, torch.Tensor]:
    """The state dict a checkpoint offers for `weights`: `raw`, `ema` (the averaged
    parameters of `--ema-decay` over the raw buffers) or `auto` (ema where the file has
    it, else raw).

    A run's `checkpoint_best.pt` holds one set of weights, the ones validated: with
    `--ema-decay` those are the EMA weights (its meta says so), which `ema` and `auto`
    accept and `raw` refuses (the raw weights of that step are in no file)."""
    if weights not in WEIGHTS:
        raise UsageError(f"unknown weights {weights!r}; choose one of: {', '.join(WEIGHTS)}")
    ema = payload.get("ema")
    meta = payload.get("meta")
    best = meta.get("best") if isinstance(meta, dict) else None
    ema_only = not ema and isinstance(best, dict) and best.get("ema") is True
    if ema_only:
        if weights == "raw":
            raise CheckpointError(f"{path or 'checkpoint'}: holds only the EMA weights "
                                  "validated as the best (an --ema-decay run's best model); "
                                  "use --weights ema or auto, or checkpoint_last.pt for raw")
        return payload["model"]
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
    from nmt.data.vocab import Vocab
    from nmt.model.transformer import Transformer

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
