"""Frozen configuration dataclasses: the one place every default lives.

Defaults are the paper's (Vaswani et al. 2017, see PAPER.md); a recipe overrides them, and
CLI flags override the recipe. `ModelConfig` is stored in every checkpoint and is enough to
rebuild the model.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Literal

from nmt.errors import UsageError

Precision = Literal["fp32", "bf16", "fp16", "auto"]
# auto: bf16 where the hardware computes it natively, fp16 on older GPUs, else fp32.
PRECISIONS: tuple[str, ...] = ("fp32", "bf16", "fp16", "auto")
DEVICES: tuple[str, ...] = ("auto", "cpu", "cuda")  # auto: CUDA when a GPU is visible
# Validation metrics `--best-metric` may track, with the direction that is better.
BEST_METRICS: dict[str, Literal["lower", "higher"]] = {
    "loss": "lower", "bleu": "higher", "chrf": "higher"}
# Learning-rate schedules by name; their builders: nmt/train/schedule.py SCHEDULES.
LR_SCHEDULES: tuple[str, ...] = ("inverse_sqrt",)  # the paper's (section 5.3)
# Decoding also offers int8 (CPU only: int8 linear layers, see nmt/inference/int8_linear.py).
DECODE_PRECISIONS: tuple[str, ...] = (*PRECISIONS, "int8")


@dataclass(frozen=True)
class ModelConfig:
    """Transformer shape and regularisation; every Table 3 knob is a field."""

    vocab_size: int = 37000
    encoder_layers: int = 6
    decoder_layers: int = 6
    d_model: int = 512
    d_ff: int = 2048
    heads: int = 8
    d_k: int | None = None  # None: d_model // heads (Table 3 rows A/B vary it)
    d_v: int | None = None  # None: d_model // heads
    dropout: float = 0.1  # residual dropout and dropout on embeddings + positions
    attention_dropout: float = 0.0  # dropout on attention weights (not in the paper)
    activation_dropout: float = 0.0  # dropout after the FFN ReLU (not in the paper)
    learned_positions: bool = False  # Table 3 row E
    max_positions: int = 1024  # longest sequence (tokens incl. EOS) the model accepts
    pre_norm: bool = False  # False: post-norm LayerNorm(x + Dropout(Sublayer(x))) as published
    pad_id: int = 0

    @property
    def head_dim_k(self) -> int:
        """Per-head query/key size."""
        return self.d_k if self.d_k is not None else self.d_model // self.heads

    @property
    def head_dim_v(self) -> int:
        """Per-head value size."""
        return self.d_v if self.d_v is not None else self.d_model // self.heads

    def __post_init__(self) -> None:
        _check_positive(self, ("vocab_size", "encoder_layers", "decoder_layers", "d_model",
                               "d_ff", "heads", "max_positions"))
        if self.d_k is None and self.d_model % self.heads:
            raise UsageError(f"d_model {self.d_model} is not divisible by heads {self.heads}; "
                             "pick another head count or set d_k/d_v")
        for name in ("dropout", "attention_dropout", "activation_dropout"):
            _check_probability(name, getattr(self, name))

    def to_dict(self) -> dict[str, Any]:
        """Plain dict (ints, floats, bools, None) for checkpoints and logs."""
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ModelConfig:
        """Rebuild from `to_dict()` output; unknown keys are an error, not ignored."""
        return _from_dict(cls, data)


# The ModelConfig fields a user sets (flags, recipes); vocab_size and pad_id come from the data.
SETTABLE_MODEL_FIELDS: tuple[str, ...] = tuple(
    f.name for f in dataclasses.fields(ModelConfig) if f.name not in ("vocab_size", "pad_id"))
DEFAULT_ARCH = "base"  # the paper's base model, unless a recipe or --arch says otherwise

MODEL_PRESETS: dict[str, dict[str, Any]] = {
    # For unit tests: trains in seconds on a CPU.
    "tiny": dict(encoder_layers=2, decoder_layers=2, d_model=64, d_ff=128, heads=4,
                 dropout=0.0),
    # The CPU / Multi30k size (issue: 3+3 layers, d_model 256, d_ff 1024, 4 heads).
    "small": dict(encoder_layers=3, decoder_layers=3, d_model=256, d_ff=1024, heads=4,
                  dropout=0.1),
    # The paper's Table 3 rows "base" and "big" (big uses P_drop 0.3 for En-De).
    "base": dict(encoder_layers=6, decoder_layers=6, d_model=512, d_ff=2048, heads=8,
                 dropout=0.1),
    "big": dict(encoder_layers=6, decoder_layers=6, d_model=1024, d_ff=4096, heads=16,
                dropout=0.3),
}


def model_preset(name: str, **overrides: Any) -> ModelConfig:
    """ModelConfig of preset `name` with `overrides` (None values are ignored)."""
    if name not in MODEL_PRESETS:
        raise UsageError(f"unknown arch {name!r}; choose one of: {', '.join(MODEL_PRESETS)}")
    values = dict(MODEL_PRESETS[name])
    values.update({k: v for k, v in overrides.items() if v is not None})
    return ModelConfig(**values)


@dataclass(frozen=True)
class TrainConfig:
    """Optimisation, batching, precision, checkpointing and logging settings."""

    seed: int = 1
    # Optimiser and schedule (section 5.3): Adam(0.9, 0.98, 1e-9), inverse sqrt with warmup.
    adam_beta1: float = 0.9
    adam_beta2: float = 0.98
    adam_eps: float = 1e-9
    lr_schedule: str = "inverse_sqrt"  # see LR_SCHEDULES
    lr_scale: float = 1.0  # multiplies d_model^-0.5 * min(step^-0.5, step * warmup^-1.5)
    warmup: int = 4000
    weight_decay: float = 0.0
    clip_norm: float = 0.0  # 0: no gradient clipping (the paper uses none)
    label_smoothing: float = 0.1
    # Batching (section 5.1): ~25000 source + 25000 target tokens per update.
    max_tokens: int = 4096  # per process per micro-batch, padding included
    update_freq: int = 1  # micro-batches accumulated per update
    batch_tokens: int | None = None  # e.g. 25000: derive update_freq from world size
    max_len: int = 256  # training pairs with a longer side (tokens incl. EOS) are skipped
    precision: Precision = "auto"  # bf16 where native (Ampere+ GPU, bf16 CPU), fp16 on older
    # GPUs, else fp32 (see nmt/precision.py)
    # Length of training (totals, not increments: a resumed run stops at the same place).
    max_updates: int = 100_000
    max_epochs: int = 0  # 0: no limit
    max_minutes: float = 0.0  # 0: no limit
    # Checkpoints (section 6: every 10 minutes, average the last 5 / 20).
    save_interval_minutes: float = 10.0
    save_interval_updates: int = 0  # 0: only time-based saves
    keep_last: int = 20
    # Validation, the best model and early stopping, weight averaging, logging.
    valid_interval: int = 1000
    valid_bleu: bool = False  # also decode the valid split: sacreBLEU and chrF
    valid_beam: int = 0  # beam for that decoding; 0: translate's (DecodeConfig.beam), 1: greedy
    best_metric: str = "loss"  # loss | bleu | chrf: decides checkpoint_best.pt
    patience: int = 0  # stop after this many validations without improvement; 0: never
    ema_decay: float = 0.0  # exponential moving average of the weights; 0: off
    log_interval: int = 50
    max_nonfinite_in_a_row: int = 20  # stop with an error after this many skipped steps

    def __post_init__(self) -> None:
        if self.precision not in PRECISIONS:
            raise UsageError(f"unknown precision {self.precision!r}; "
                             f"choose one of: {', '.join(PRECISIONS)}")
        _check_positive(self, ("warmup", "max_tokens", "update_freq", "max_len", "keep_last",
                               "valid_interval", "log_interval", "max_nonfinite_in_a_row",
                               "max_updates", "lr_scale", "adam_eps"))
        if self.batch_tokens is not None:
            _check_positive(self, ("batch_tokens",))
        _check_non_negative(self, ("seed", "max_epochs", "max_minutes", "weight_decay",
                                   "clip_norm", "save_interval_minutes",
                                   "save_interval_updates"))
        _check_probability("adam_beta1", self.adam_beta1)
        _check_probability("adam_beta2", self.adam_beta2)
        _check_probability("label_smoothing", self.label_smoothing)
        _check_probability("ema_decay", self.ema_decay)
        if self.lr_schedule not in LR_SCHEDULES:
            raise UsageError(f"unknown lr schedule {self.lr_schedule!r}; choose one of: "
                             f"{', '.join(LR_SCHEDULES)}")
        if self.best_metric not in BEST_METRICS:
            raise UsageError(f"unknown best metric {self.best_metric!r}; choose one of: "
                             f"{', '.join(BEST_METRICS)}")
        if self.valid_beam < 0:
            raise UsageError(f"valid-beam must be >= 0, got {self.valid_beam}")
        if self.patience < 0:
            raise UsageError(f"patience must be >= 0, got {self.patience}")

    @property
    def decode_valid(self) -> bool:
        """Validation decodes the valid split (for BLEU/chrF, asked for or needed)."""
        return self.valid_bleu or self.best_metric != "loss"

    def to_dict(self) -> dict[str, Any]:
        """Plain dict for checkpoints and logs."""
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> TrainConfig:
        """Rebuild from `to_dict()` output; unknown keys are an error."""
        return _from_dict(cls, data)


@dataclass(frozen=True)
class DecodeConfig:
    """Search and batching settings of translation (what a Translator reads on every
    batch); the search defaults are the paper's (section 6.1). How the model runs (device,
    precision, weights, seed, input errors) is `RuntimeConfig`."""

    beam: int = 4
    alpha: float = 0.6  # GNMT length penalty exponent; larger favours longer output
    max_len_a: float = 1.0  # max output length = a * source length + b (paper: input + 50)
    max_len_b: int = 50
    min_len: int = 1  # EOS forbidden before this many pieces (fairseq's default too)
    nbest: int = 1
    sampling: bool = False
    temperature: float = 1.0
    top_k: int = 0  # 0: no top-k filter
    top_p: float = 1.0  # 1.0: no nucleus filter
    max_tokens: int = 8192  # per batch: padded tokens of the (source) side, EOS included,
    # as training's --max-tokens counts them (nmt.data.batching.batch_by_tokens)
    buffer_size: int = 2000  # lines read ahead and length-sorted before batching

    def __post_init__(self) -> None:
        _check_positive(self, ("beam", "nbest", "max_tokens", "buffer_size"))
        _check_non_negative(self, ("max_len_a", "max_len_b", "top_k"))
        if self.nbest > self.beam and not self.sampling:
            raise UsageError(f"--nbest {self.nbest} exceeds --beam {self.beam}; "
                             "raise the beam or lower nbest")
        if self.alpha < 0:
            raise UsageError(f"--alpha must be >= 0, got {self.alpha}")
        if self.min_len < 0:
            raise UsageError(f"--min-len must be >= 0, got {self.min_len}")
        if not 0.0 < self.top_p <= 1.0:
            raise UsageError(f"--top-p must be in (0, 1], got {self.top_p}")
        if self.temperature <= 0:
            raise UsageError(f"--temperature must be > 0, got {self.temperature}")


WEIGHTS: tuple[str, ...] = ("auto", "raw", "ema")  # which weights of an --ema-decay checkpoint
ERROR_MODES: tuple[str, ...] = ("replace", "strict")  # invalid UTF-8 in translation input


@dataclass(frozen=True)
class RuntimeConfig:
    """How a model runs for translation: `nmt translate`'s flags and the Python API's
    defaults, checked once here (the device's availability is checked when resolved)."""

    device: str = "auto"  # see DEVICES
    precision: str = "auto"  # see DECODE_PRECISIONS: bf16 where native, else fp32
    weights: str = "auto"  # see WEIGHTS: a checkpoint's EMA weights where it has them
    seed: int = 1  # for --sampling
    errors: str = "replace"  # see ERROR_MODES: replace (U+FFFD) | strict (exit 3)

    def __post_init__(self) -> None:
        _check_non_negative(self, ("seed",))
        for name, choices in (("device", DEVICES), ("precision", DECODE_PRECISIONS),
                              ("weights", WEIGHTS), ("errors", ERROR_MODES)):
            value = getattr(self, name)
            if value not in choices:
                raise UsageError(f"unknown --{name} {value!r}; choose one of: "
                                 f"{', '.join(choices)}")


def _check_positive(obj: object, names: tuple[str, ...]) -> None:
    for name in names:
        value = getattr(obj, name)
        if value <= 0:
            raise UsageError(f"{name.replace('_', '-')} must be positive, got {value}")


def _check_non_negative(obj: object, names: tuple[str, ...]) -> None:
    for name in names:
        value = getattr(obj, name)
        if value < 0:
            raise UsageError(f"{name.replace('_', '-')} must be >= 0, got {value}")


def _check_probability(name: str, value: float) -> None:
    if not 0.0 <= value < 1.0:
        raise UsageError(f"{name.replace('_', '-')} must be in [0, 1), got {value}")


def _from_dict(cls: type, data: dict[str, Any]) -> Any:
    known = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - known)
    if unknown:
        raise UsageError(f"unknown {cls.__name__} keys: {', '.join(unknown)}; "
                         f"valid keys: {', '.join(sorted(known))}")
    return cls(**data)
