"""Frozen configuration dataclasses: the one place every default lives.

Defaults are the paper's (Vaswani et al. 2017, see docs/design.md); a recipe overrides them, and
CLI flags override the recipe. `ModelConfig` is stored in every checkpoint and is enough to
rebuild the model.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Literal

from nmt.errors import UsageError

Precision = Literal["fp32", "bf16", "fp16", "auto"]
# auto: bf16 on GPUs that compute it natively, fp16 on older ones; on a CPU bf16 where it is
# native and faster than fp32, else fp32 (nmt.precision.resolve_precision).
PRECISIONS: tuple[str, ...] = ("fp32", "bf16", "fp16", "auto")
DEVICES: tuple[str, ...] = ("auto", "cpu", "cuda")  # auto: CUDA when a GPU is visible
# Validation metrics `--best-metric` may track, with the direction that is better.
BEST_METRICS: dict[str, Literal["lower", "higher"]] = {
    "loss": "lower", "bleu": "higher", "chrf": "higher"}
# Learning-rate schedules by name; their builders: nmt/train/schedule.py SCHEDULES.
# inverse_sqrt: the paper's (section 5.3); the others decay to the end of the budget.
LR_SCHEDULES: tuple[str, ...] = ("inverse_sqrt", "linear", "cosine", "wsd")
DROPOUT_SCHEDULES: tuple[str, ...] = ("constant", "linear")
FUSED_LOSS: tuple[str, ...] = ("auto", "on", "off")  # TrainConfig.fused_loss
HALF_WEIGHTS: tuple[str, ...] = ("auto", "on", "off")  # TrainConfig.half_weights
# Decoding also offers int8 (CPU only: int8 linear layers, see nmt/inference/int8_linear.py).
DECODE_PRECISIONS: tuple[str, ...] = (*PRECISIONS, "int8")


def _setting(default: Any, help_text: str, *, flag: str | None = None,
             shown_default: str | None = None) -> Any:
    """A dataclass field that documents itself, for the commands' options (cli/options.py
    builds one flag per such field, so names, defaults and help live here only). Metadata,
    plain strings: `help`; `flag` where the option is not `--field-name` (`--x/--no-x` for
    a bool); `shown_default` where --help should not show the default value itself."""
    metadata = {"help": help_text}
    if flag is not None:
        metadata["flag"] = flag
    if shown_default is not None:
        metadata["shown_default"] = shown_default
    return dataclasses.field(default=default, metadata=metadata)


@dataclass(frozen=True)
class ModelConfig:
    """Transformer shape and regularisation; every Table 3 knob is a field."""

    vocab_size: int = 37000
    encoder_layers: int = _setting(6, "Encoder layers N.")
    decoder_layers: int = _setting(6, "Decoder layers N.")
    d_model: int = _setting(512, "Model width d_model.")
    d_ff: int = _setting(2048, "Feed-forward inner size d_ff.")
    heads: int = _setting(8, "Attention heads h.")
    # Table 3 rows A/B vary d_k and d_v.
    d_k: int | None = _setting(None, "Per-head query/key size (None: d_model / h).")
    d_v: int | None = _setting(None, "Per-head value size (None: d_model / h).")
    dropout: float = _setting(0.1, "Residual + embedding dropout P_drop.")
    # Not in the paper: dropout on attention weights and after the FFN ReLU.
    attention_dropout: float = _setting(0.0, "Dropout on attention weights.")
    activation_dropout: float = _setting(0.0, "Dropout after the FFN ReLU.")
    learned_positions: bool = _setting(
        False, "Learned positional embeddings instead of sinusoids (Table 3 row E).",
        flag="--learned-positions/--sinusoidal-positions", shown_default="sinusoidal")
    max_positions: int = _setting(1024, "Longest sequence the model accepts.")  # incl. EOS
    # False: post-norm LayerNorm(x + Dropout(Sublayer(x))) as published.
    pre_norm: bool = _setting(False, "LayerNorm before each sub-layer instead of after.",
                              flag="--pre-norm/--post-norm", shown_default="post-norm")
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
    # The CPU / Multi30k size.
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

    seed: int = _setting(1, "Random seed.")
    # Optimiser and schedule (section 5.3): inverse sqrt with warmup, Adam(0.9, 0.98, 1e-9).
    lr_schedule: str = _setting(  # see LR_SCHEDULES
        "inverse_sqrt",
        "Learning-rate schedule; inverse_sqrt: the paper's warm-up then 1/sqrt(step); "
        "linear, cosine, wsd: warm-up to the same peak, then down to --lr-final at the end "
        "of the budget (--max-updates, --max-minutes or --max-epochs, whichever ends "
        "first); wsd holds the peak until the last --decay-fraction of it.")
    dropout_schedule: str = _setting(  # see DROPOUT_SCHEDULES
        "constant",
        "constant: the model's dropout rates throughout; linear: every rate rises from 0 at "
        "the start to its set value (--dropout, --attention-dropout, "
        "--activation-dropout) at the end of the budget that --lr-schedule follows "
        "(curriculum dropout: learn fast first, regularise late).")
    dropout_epochs: float = _setting(
        0.0, "With --dropout-schedule linear: the epochs the rates need to reach their set "
        "values; a budget that holds fewer raises them in proportion to the epochs seen "
        "instead (the rate: set value x the smaller of the budget's progress and epochs "
        "seen / this), so a slower machine regularises less. 0: the budget's progress "
        "alone. Ignored by --dropout-schedule constant.")
    lr_scale: float = _setting(
        1.0, "Multiplies d_model^-0.5 * min(step^-0.5, step * warmup^-1.5) (the peak, "
        "lr_scale * d_model^-0.5 * warmup^-0.5, for every schedule).")
    lr_final: float = _setting(
        0.0, "linear/cosine/wsd: the learning rate at the end of the budget, as a "
        "fraction of the peak.")
    decay_fraction: float = _setting(
        0.2, "wsd: the share of the budget after warm-up over which it decays.")
    warmup: int = _setting(4000, "Warm-up updates of the schedule.")
    adam_beta1: float = _setting(0.9, "Adam's beta1 (decay of the gradient average).")
    adam_beta2: float = _setting(0.98, "Adam's beta2 (decay of the squared gradient average).")
    adam_eps: float = _setting(1e-9, "Adam's epsilon.")
    weight_decay: float = _setting(0.0, "Adam's L2 weight decay (the paper uses none).")
    clip_norm: float = _setting(0.0, "Clip the gradient norm; 0 = no clipping.")  # paper: 0
    label_smoothing: float = _setting(0.1, "epsilon_ls.")
    # Batching (section 5.1): ~25000 source + 25000 target tokens per update.
    max_tokens: int = _setting(
        4096, "Tokens (padding included) per process per micro-batch; 0 = from the GPU's "
        "memory with --batch-tokens (up to the whole update in one micro-batch), else 4096.")
    update_freq: int = _setting(1, "Micro-batches accumulated per update.")
    batch_tokens: int | None = _setting(
        None, "Real tokens per side per update, (source + target) / 2 without padding "
        "(paper: 25000); derives update-freq and the micro-batch size (at most max-tokens) "
        "for the number of processes from how full the data's batches are measured to be.",
        shown_default="off")
    # auto: fused on CUDA (it never holds the (rows, vocab) logits, at no loss of speed:
    # docs/performance.md), reference on a CPU (where recomputing the logits costs time).
    fused_loss: str = _setting(  # see FUSED_LOSS
        "auto", "auto | on | off: project to the vocabulary chunk by chunk inside the loss "
        "(never the whole logits); auto = on for CUDA, off for a CPU.")
    compile: bool = _setting(
        False, "torch.compile the model, batches padded to a few length buckets (one graph "
        "each): fused kernels and fewer launches per micro-batch, for a GPU that waits on "
        "the host; each bucket's first batch compiles (a minute or more in all).")
    cuda_graphs: bool = _setting(
        False, "With --compile: every shape static (rows padded too) and each bucket's step "
        "replayed as a CUDA graph (torch.compile's reduce-overhead mode); CUDA only.")
    half_weights: str = _setting(  # see HALF_WEIGHTS
        "auto", "auto | on | off: with bf16, compute on a bf16 copy of the weights (fp32 "
        "master weights in the optimizer, no autocast casts, the output matrix padded to a "
        "multiple of 64 rows); auto = on for CUDA, off for a CPU.")
    max_len: int = _setting(
        256, "Skip training pairs with a side longer than this (tokens incl. EOS).")
    # auto: bf16 where native (Ampere+ GPU; a CPU where it also beats fp32), fp16 on older
    # GPUs, else fp32 (see nmt/precision.py).
    precision: Precision = _setting(
        "auto", f"One of {', '.join(PRECISIONS)} (autocast; fp16 uses dynamic loss scaling).")
    # Length of training (totals, not increments: a resumed run stops at the same place).
    max_updates: int = _setting(
        100_000, "Total updates (a resumed run stops at the same place).")
    max_epochs: int = _setting(0, "Total epochs; 0 = no limit.")
    max_minutes: float = _setting(0.0, "Total training minutes; 0 = no limit.")
    # Checkpoints (section 6: every 10 minutes, average the last 5 / 20).
    save_interval_minutes: float = _setting(
        10.0, "Save every this many minutes (paper: 10); 0 = off.")
    save_interval_updates: int = _setting(0, "Also save every this many updates; 0 = off.")
    keep_last: int = _setting(20, "Numbered checkpoints kept (paper averages 5 / 20).")
    # Validation, the best model and early stopping, weight averaging, logging.
    valid_interval: int = _setting(1000, "Validate every this many updates.")
    valid_bleu: bool = _setting(False, "Also decode the valid split: sacreBLEU and chrF.")
    # 0: translate's beam; the shown default names DecodeConfig.beam (a test keeps it so).
    valid_beam: int = _setting(0, "Beam for --valid-bleu decoding; 1 = greedy (faster).",
                               shown_default="translate's beam (4)")
    best_metric: str = _setting(  # see BEST_METRICS
        "loss", "loss | bleu | chrf: the validation score that picks RUN/checkpoint_best.pt "
        "(bleu/chrf decode the valid split).")
    patience: int = _setting(
        0, "Stop after this many validations in a row without a better --best-metric; "
        "0 = never.")
    ema_decay: float = _setting(
        0.0, "Keep an exponential moving average of the weights (e.g. 0.9999), validated "
        "and saved beside them; translate/average use it by default. 0 = off.")
    log_interval: int = _setting(50, "Log every this many updates.")
    max_nonfinite_in_a_row: int = _setting(
        20, "Abort (exit 7) after this many skipped non-finite updates in a row.")

    def __post_init__(self) -> None:
        if self.precision not in PRECISIONS:
            raise UsageError(f"unknown precision {self.precision!r}; "
                             f"choose one of: {', '.join(PRECISIONS)}")
        _check_positive(self, ("warmup", "update_freq", "max_len", "keep_last",
                               "valid_interval", "log_interval", "max_nonfinite_in_a_row",
                               "max_updates", "lr_scale", "adam_eps"))
        if self.batch_tokens is not None:
            _check_positive(self, ("batch_tokens",))
        _check_non_negative(self, ("max_tokens", "seed", "max_epochs", "max_minutes",
                                   "weight_decay", "clip_norm", "save_interval_minutes",
                                   "save_interval_updates", "dropout_epochs"))
        _check_probability("adam_beta1", self.adam_beta1)
        _check_probability("adam_beta2", self.adam_beta2)
        _check_probability("label_smoothing", self.label_smoothing)
        _check_probability("lr_final", self.lr_final)
        if not 0.0 < self.decay_fraction <= 1.0:
            raise UsageError(f"decay-fraction must be in (0, 1], got {self.decay_fraction}")
        _check_probability("ema_decay", self.ema_decay)
        if self.lr_schedule not in LR_SCHEDULES:
            raise UsageError(f"unknown lr schedule {self.lr_schedule!r}; choose one of: "
                             f"{', '.join(LR_SCHEDULES)}")
        if self.dropout_schedule not in DROPOUT_SCHEDULES:
            raise UsageError(f"unknown dropout schedule {self.dropout_schedule!r}; choose "
                             f"one of: {', '.join(DROPOUT_SCHEDULES)}")
        if self.dropout_schedule != "constant" and self.compile:
            raise UsageError("--dropout-schedule linear changes the dropout rates every "
                             "update, which a compiled model would recompile for; use "
                             "--no-compile or --dropout-schedule constant")
        if self.cuda_graphs and not self.compile:
            raise UsageError("--cuda-graphs replays the compiled step: add --compile")
        if self.half_weights not in HALF_WEIGHTS:
            raise UsageError(f"unknown half-weights {self.half_weights!r}; choose one of: "
                             f"{', '.join(HALF_WEIGHTS)}")
        if self.fused_loss not in FUSED_LOSS:
            raise UsageError(f"unknown fused-loss {self.fused_loss!r}; choose one of: "
                             f"{', '.join(FUSED_LOSS)}")
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
    """Search and batching settings of translation (what the translation engine reads on every
    batch); the search defaults are the paper's (section 6.1). How the model runs (device,
    precision, weights, seed, input errors) is `RuntimeConfig`."""

    beam: int = _setting(4, "Beam size.")
    alpha: float = _setting(0.6, "GNMT length penalty ((5+|Y|)/6)^alpha, |Y| counting EOS; "
                            "0 = raw log-probability; a larger alpha favours longer output.")
    max_len_a: float = _setting(1.0, "Max output pieces = a * source tokens + b (per "
                                "sentence, source counted with EOS; the paper: input + 50).")
    max_len_b: int = _setting(50, "See --max-len-a.")
    min_len: int = _setting(1, "Min output pieces before EOS may end a hypothesis (1: a "
                            "non-empty line never gets an empty translation; 0: allow it). "
                            "--max-len-a/b win where they conflict.")
    # EARLY_STOPS: "bound" is the paper's code's (tensor2tensor's) rule, "beam" fairseq's,
    # CTranslate2's and Marian's.
    early_stop: str = _setting("bound", "When a sentence's search ends: bound (once no "
                               "unfinished hypothesis can beat the finished ones: the "
                               "paper's code, the best the beam can find) | beam (once beam "
                               "hypotheses have finished, as fairseq and CTranslate2: fewer "
                               "steps, faster).")
    nbest: int = _setting(1, "Hypotheses per line; > 1 prints index<TAB>score<TAB>text lines "
                          "(index from 0).")
    sampling: bool = _setting(False, "Sample instead of beam search.", flag="--sampling")
    temperature: float = _setting(1.0, "Sampling temperature.")
    top_k: int = _setting(0, "Sample among the k best tokens; 0 = all.")
    top_p: float = _setting(1.0, "Nucleus sampling mass; 1.0 = off.")
    # Padded source tokens per batch, EOS included, as training's --max-tokens counts them
    # (nmt.data.batching.batch_by_tokens); None: by device (MAX_TOKENS_BY_DEVICE),
    # resolved by the engine.
    max_tokens: int | None = _setting(None, "Source tokens per batch, padding included.",
                                      shown_default="2048 on a CPU, 8192 on a GPU")
    buffer_size: int = _setting(2000, "Lines read ahead and length-sorted.")

    def __post_init__(self) -> None:
        _check_positive(self, ("beam", "nbest", "buffer_size"))
        if self.max_tokens is not None:
            _check_positive(self, ("max_tokens",))
        _check_non_negative(self, ("max_len_a", "max_len_b", "top_k"))
        if self.nbest > self.beam and not self.sampling:
            raise UsageError(f"--nbest {self.nbest} exceeds --beam {self.beam}; "
                             "raise the beam or lower nbest")
        if self.alpha < 0:
            raise UsageError(f"--alpha must be >= 0, got {self.alpha}")
        if self.early_stop not in EARLY_STOPS:
            raise UsageError(f"unknown --early-stop {self.early_stop!r}; choose one of: "
                             f"{', '.join(EARLY_STOPS)}")
        if self.min_len < 0:
            raise UsageError(f"--min-len must be >= 0, got {self.min_len}")
        if not 0.0 < self.top_p <= 1.0:
            raise UsageError(f"--top-p must be in (0, 1], got {self.top_p}")
        if self.temperature <= 0:
            raise UsageError(f"--temperature must be > 0, got {self.temperature}")


# Beam search's stopping rules (nmt.inference.search.EARLY_STOPS, held equal by a test).
EARLY_STOPS: tuple[str, ...] = ("bound", "beam")
# Translation batches by device type when --max-tokens is not given. A GPU wants large
# batches; on a CPU a beam-search step is compute-bound from a few hundred rows on, so a
# smaller batch costs one worker nothing and lets several workers share a buffer evenly
# (figures in docs/performance.md).
MAX_TOKENS_BY_DEVICE: dict[str, int] = {"cpu": 2048, "cuda": 8192}
MAX_TOKENS_OTHER = 8192


def max_tokens_for(device_type: str) -> int:
    """The default translation batch size (source tokens) on a device of that type."""
    return MAX_TOKENS_BY_DEVICE.get(device_type, MAX_TOKENS_OTHER)


WEIGHTS: tuple[str, ...] = ("auto", "raw", "ema")  # which weights of an --ema-decay checkpoint
ERROR_MODES: tuple[str, ...] = ("replace", "strict")  # invalid UTF-8 in translation input


@dataclass(frozen=True)
class RuntimeConfig:
    """How a model runs for translation: `nmt translate`'s flags and the Python API's
    defaults, checked once here (the device's availability is checked when resolved)."""

    device: str = _setting("auto", "auto | cpu | cuda.")  # see DEVICES
    precision: str = _setting(  # see DECODE_PRECISIONS
        "auto", "auto | fp32 | bf16 | fp16 | int8 model weights (int8: CPU only, int8 linear "
        "layers, see docs/translating.md). auto: bf16 where the GPU computes it natively "
        "(fp16 on pre-Ampere GPUs) or the CPU does (AVX512-BF16/AMX) and measured faster "
        "than fp32, else fp32; as `train` does. "
        "Outputs may differ from fp32 in rounding only. On a CPU the linears run through "
        "oneDNN with packed weights (fp32 and bf16).")
    weights: str = _setting("auto", "auto | raw | ema: which weights of a checkpoint trained "
                            "with --ema-decay to use (auto: the EMA ones where the file has "
                            "them).")  # see WEIGHTS
    seed: int = _setting(1, "Seed for --sampling.")
    errors: str = _setting("replace", "Invalid UTF-8: 'replace' (U+FFFD) or 'strict' (exit 3 "
                           "naming the line).")  # see ERROR_MODES

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
