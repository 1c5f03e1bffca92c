"""Fine-tuning (`nmt train DATA --init-from MODEL.pt`): may this model start this run?

The model file (a training checkpoint, checkpoint_best.pt or an `nmt average` output) must
have been trained on the same sentencepiece vocabulary as DATA (encode new data with
`nmt bpe DATA --spm-from MODEL.pt`) and have the architecture this run asks for. Dropout
and the other regularisation settings may differ: they are the new run's.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from nmt.config import ModelConfig
from nmt.errors import CheckpointError

# ModelConfig fields that only regularise: a fine-tuning run may change them.
REGULARISATION = ("dropout", "attention_dropout", "activation_dropout")


def check_init_from(payload: dict[str, Any], path: Path, model_cfg: ModelConfig,
                    vocab_proto: bytes) -> None:
    """CheckpointError (exit 6), one line, when `payload` cannot start this run."""
    if bytes(payload["vocab"]) != bytes(vocab_proto):
        raise CheckpointError(f"{path}: its vocabulary differs from DATA's; encode DATA with "
                              f"`nmt bpe DATA --spm-from {path}` so the ids match")
    try:
        parent = ModelConfig.from_dict(payload["model_config"]).to_dict()
    except Exception as err:
        raise CheckpointError(f"{path}: unreadable model config ({err})") from err
    wanted = model_cfg.to_dict()
    differ = [k for k in wanted if k not in REGULARISATION and wanted[k] != parent.get(k)]
    if differ:
        detail = ", ".join(f"{k} {parent.get(k)} there vs {wanted[k]} here" for k in differ)
        raise CheckpointError(f"{path}: another architecture ({detail}); pass the flags "
                              "the model was trained with (e.g. --arch)")
