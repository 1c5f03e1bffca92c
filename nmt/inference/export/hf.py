"""Export an nmt checkpoint as a Hugging Face transformers model (`MarianMTModel`), loaded
by `AutoModelForSeq2SeqLM`, `AutoTokenizer` and `pipeline("translation")` with no code of
ours (needs `pip install 'nmt[hf]'`).

The paper's post-norm Transformer is Marian's architecture, with these correspondences,
each checked by tests/inference/test_export_hf.py against nmt's own log-probabilities:
- Sinusoids: nmt interleaves sines and cosines (PE[2i] = sin, PE[2i+1] = cos); Marian puts
  the sines in the first half of the vector and the cosines in the second, same
  frequencies, positions from 0 in both. No table can be swapped in (Marian rebuilds its
  own), so the export permutes the model's d_model channels instead: channel 2i goes to i
  and 2i+1 to d/2 + i in every weight that reads or writes the residual stream
  (embeddings, Q/K/V and FFN inputs, attention and FFN outputs, LayerNorms). LayerNorm and
  the dot products are indifferent to a consistent permutation, so the network computes
  the same function, and its position table becomes exactly Marian's.
- Embeddings scaled by sqrt(d_model) (`scale_embedding`), one matrix for source, target and
  output projection (`share_encoder_decoder_embeddings`, tied `lm_head`); no output bias
  in nmt, so Marian's `final_logits_bias` is zero. Attention and FFN biases map one to one
  (nmt's fused QKV and K|V are split); LayerNorm epsilon 1e-5 in both; ReLU.
- Ids: the vocabulary is the sentencepiece model's, id for id (vocab.json); PAD 0, UNK 1,
  EOS 3, and decoding starts from nmt's BOS 2 (`decoder_start_token_id`); sources get EOS
  appended by MarianTokenizer, as nmt's sources are pieces + EOS.
Not expressible, so refused with one line (never a model that loads and translates
wrongly): pre-norm (Marian has no final LayerNorm per stack and no pre-norm switch),
learned positions, and per-head sizes d_k, d_v other than d_model / heads.
"""

from __future__ import annotations

import contextlib
import json
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from nmt.data.vocab import BOS_ID, EOS_ID, PAD_ID, UNK_ID
from nmt.errors import CheckpointError, UsageError
from nmt.inference.export.common import (
    Exported,
    check_output,
    language_pair,
    read_checkpoint,
    replace_dir,
    temp_dir,
    training_story,
)

INSTALL_HINT = ("transformers is not installed; install it with: pip install 'nmt[hf]' "
                "(transformers and safetensors)")

CARD = """---
library_name: transformers
pipeline_tag: translation
{languages}tags: [translation, marian, nmt]
---

# {name}: {pair} translation, exported by `nmt export hf`

A Transformer ("Attention Is All You Need") trained with nmt and exported from
`{checkpoint}` as a `MarianMTModel`, weights in safetensors. The export is exact:
transformers computes the same log-probabilities as nmt, to float rounding.

{story}

## Use

```python
from transformers import AutoModelForSeq2SeqLM, AutoTokenizer

tokenizer = AutoTokenizer.from_pretrained("{name}")
model = AutoModelForSeq2SeqLM.from_pretrained("{name}")
batch = tokenizer(["A dog runs on the beach."], return_tensors="pt", padding=True)
print(tokenizer.batch_decode(model.generate(**batch), skip_special_tokens=True))
```

With transformers 4.x (5.x removed the task), the pipeline works as well:

```python
from transformers import pipeline

translate = pipeline("translation", model="{name}")
print(translate("A dog runs on the beach.")[0]["translation_text"])
```

## Where transformers decodes differently from `nmt translate`

The generation config carries the paper's beam 4 and alpha 0.6, but transformers' length
penalty divides a hypothesis' log-probability by length ** alpha, where `nmt translate`
divides by GNMT's ((5 + length) / 6) ** alpha, and its maximum length is a fixed
`max_length` ({max_length} tokens here) where nmt allows each sentence 1.0 x its source
length + 50 pieces. With `length_penalty=0` and greedy or beam search, the two agree on
nearly every sentence (differences come from float rounding between near-equal
candidates). PAD and the start token are never generated (`bad_words_ids`), and EOS is
not allowed as the first token (`min_new_tokens=1`), as in nmt.
"""


def import_transformers() -> Any:
    """The transformers module, or a UsageError that says how to install it."""
    try:
        import safetensors  # noqa: F401 - save_pretrained writes safetensors with it
        import transformers
    except ImportError as err:
        raise UsageError(INSTALL_HINT) from err
    return transformers


@contextlib.contextmanager
def _quiet(transformers: Any) -> Iterator[None]:
    """transformers' warnings and progress bars off while exporting (our own messages say
    what happened), and back as they were afterwards: a library caller keeps its settings."""
    logging = transformers.utils.logging
    verbosity, bars = logging.get_verbosity(), logging.is_progress_bar_enabled()
    logging.set_verbosity_error()
    logging.disable_progress_bar()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # e.g. notes on generation settings
            yield
    finally:
        logging.set_verbosity(verbosity)
        if bars:
            logging.enable_progress_bar()


def check_expressible(model: Any) -> None:
    """Refuse what a MarianMTModel cannot compute exactly: UsageError naming it."""
    cfg = model.config
    reasons = []
    if cfg.pre_norm:
        reasons.append("it is pre-norm (Marian is post-norm, with no final LayerNorm)")
    if cfg.learned_positions:
        reasons.append("it has learned positions (Marian's are fixed sinusoids)")
    if cfg.head_dim_k * cfg.heads != cfg.d_model or cfg.head_dim_v * cfg.heads != cfg.d_model:
        reasons.append(f"its heads are {cfg.head_dim_k}/{cfg.head_dim_v} wide, not "
                       f"d_model / heads = {cfg.d_model // cfg.heads}")
    if reasons:
        raise UsageError("cannot export as a transformers MarianMTModel: "
                         + "; ".join(reasons) + " (nmt export ct2 takes it)")


def halves_permutation(d_model: int) -> torch.Tensor:
    """Channel order that turns nmt's interleaved sinusoids into Marian's halves: new
    channel i reads old channel 2i (sines), new d/2 + i reads old 2i + 1 (cosines)."""
    return torch.cat([torch.arange(0, d_model, 2), torch.arange(1, d_model, 2)])


def marian_state_dict(model: Any) -> dict[str, torch.Tensor]:
    """nmt's weights under MarianMTModel's names, residual channels permuted (see the
    module docstring)."""
    cfg = model.config
    perm = halves_permutation(cfg.d_model)
    state: dict[str, torch.Tensor] = {}

    def reads(name: str, linear: torch.nn.Linear | None = None,
              weight: torch.Tensor | None = None, bias: torch.Tensor | None = None) -> None:
        """A projection reading the residual stream: permute its input columns."""
        w = linear.weight if linear is not None else weight
        b = linear.bias if linear is not None else bias
        state[f"{name}.weight"] = w[:, perm]
        state[f"{name}.bias"] = b

    def writes(name: str, linear: torch.nn.Linear) -> None:
        """A projection writing the residual stream: permute its output rows."""
        state[f"{name}.weight"] = linear.weight[perm]
        state[f"{name}.bias"] = linear.bias[perm]

    def norm(name: str, layer_norm: torch.nn.LayerNorm) -> None:
        state[f"{name}.weight"] = layer_norm.weight[perm]
        state[f"{name}.bias"] = layer_norm.bias[perm]

    embed = model.embed.weight[:, perm]  # (V, d_model)
    for name in ("model.shared", "model.encoder.embed_tokens", "model.decoder.embed_tokens",
                 "lm_head"):
        state[f"{name}.weight"] = embed
    table = model.enc_positions.table[: cfg.max_positions, perm]  # Marian's halves layout
    state["model.encoder.embed_positions.weight"] = table
    state["model.decoder.embed_positions.weight"] = table
    state["final_logits_bias"] = torch.zeros(1, cfg.vocab_size)
    for i, layer in enumerate(model.encoder):
        prefix = f"model.encoder.layers.{i}"
        _self_attention(reads, f"{prefix}.self_attn", layer.self_attn)
        writes(f"{prefix}.self_attn.out_proj", layer.self_attn.out)
        norm(f"{prefix}.self_attn_layer_norm", layer.res_attn.norm)
        reads(f"{prefix}.fc1", layer.ffn.fc1)
        writes(f"{prefix}.fc2", layer.ffn.fc2)
        norm(f"{prefix}.final_layer_norm", layer.res_ffn.norm)
    for i, layer in enumerate(model.decoder):
        prefix = f"model.decoder.layers.{i}"
        _self_attention(reads, f"{prefix}.self_attn", layer.self_attn)
        writes(f"{prefix}.self_attn.out_proj", layer.self_attn.out)
        norm(f"{prefix}.self_attn_layer_norm", layer.res_self.norm)
        cross = layer.cross_attn
        reads(f"{prefix}.encoder_attn.q_proj", cross.q)
        k_w, v_w = cross.kv.weight.split(cross.kv_sizes, dim=0)
        k_b, v_b = cross.kv.bias.split(cross.kv_sizes, dim=0)
        reads(f"{prefix}.encoder_attn.k_proj", weight=k_w, bias=k_b)
        reads(f"{prefix}.encoder_attn.v_proj", weight=v_w, bias=v_b)
        writes(f"{prefix}.encoder_attn.out_proj", cross.out)
        norm(f"{prefix}.encoder_attn_layer_norm", layer.res_cross.norm)
        reads(f"{prefix}.fc1", layer.ffn.fc1)
        writes(f"{prefix}.fc2", layer.ffn.fc2)
        norm(f"{prefix}.final_layer_norm", layer.res_ffn.norm)
    return {k: v.detach().contiguous().clone() for k, v in state.items()}


def _self_attention(reads: Any, name: str, attention: Any) -> None:
    """nmt's fused QKV as Marian's q_proj, k_proj, v_proj."""
    weights = attention.qkv.weight.split(attention.sizes, dim=0)
    biases = attention.qkv.bias.split(attention.sizes, dim=0)
    for part, w, b in zip(("q_proj", "k_proj", "v_proj"), weights, biases, strict=True):
        reads(f"{name}.{part}", weight=w, bias=b)


def marian_config(transformers: Any, exported: Exported) -> Any:
    """The MarianConfig of the exported model."""
    cfg = exported.model.config
    return transformers.MarianConfig(
        vocab_size=cfg.vocab_size, decoder_vocab_size=cfg.vocab_size,
        max_position_embeddings=cfg.max_positions, d_model=cfg.d_model,
        encoder_layers=cfg.encoder_layers, decoder_layers=cfg.decoder_layers,
        encoder_ffn_dim=cfg.d_ff, decoder_ffn_dim=cfg.d_ff,
        encoder_attention_heads=cfg.heads, decoder_attention_heads=cfg.heads,
        activation_function="relu", dropout=cfg.dropout,
        attention_dropout=cfg.attention_dropout, activation_dropout=cfg.activation_dropout,
        scale_embedding=True, share_encoder_decoder_embeddings=True,
        tie_word_embeddings=True, pad_token_id=PAD_ID, eos_token_id=EOS_ID,
        bos_token_id=BOS_ID, decoder_start_token_id=BOS_ID, forced_eos_token_id=EOS_ID,
        architectures=["MarianMTModel"])


def generation_config(transformers: Any, exported: Exported, max_length: int) -> Any:
    """The paper's decoding where transformers can say it (see CARD for where not)."""
    return transformers.GenerationConfig(
        num_beams=4, length_penalty=0.6, max_length=max_length, min_new_tokens=1,
        decoder_start_token_id=BOS_ID, bos_token_id=BOS_ID, eos_token_id=EOS_ID,
        pad_token_id=PAD_ID, forced_eos_token_id=EOS_ID, bad_words_ids=[[PAD_ID], [BOS_ID]],
        early_stopping=True)


def write_tokenizer(directory: Path, exported: Exported, source: str, target: str,
                    max_length: int) -> None:
    """MarianTokenizer's files: the sentencepiece model (source and target alike), the
    vocabulary with nmt's ids, and a config that keeps special-token strings in the text
    as text (nmt's sentencepiece encodes "</s>" typed by a user as characters)."""
    vocab = exported.vocab
    pieces = vocab.pieces(range(len(vocab)))
    if len(set(pieces)) != len(pieces):
        raise CheckpointError(f"{exported.path}: the sentencepiece model has duplicate "
                              "pieces; a vocab.json cannot map them")
    for name in ("source.spm", "target.spm"):
        (directory / name).write_bytes(vocab.proto)
    (directory / "vocab.json").write_text(
        json.dumps({piece: i for i, piece in enumerate(pieces)}, ensure_ascii=False),
        encoding="utf-8")
    (directory / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "MarianTokenizer", "source_lang": source or None,
        "target_lang": target or None,
        "unk_token": pieces[UNK_ID], "eos_token": pieces[EOS_ID],
        "pad_token": pieces[PAD_ID], "model_max_length": max_length,
        "separate_vocabs": False, "split_special_tokens": True,
    }, indent=2), encoding="utf-8")
    (directory / "special_tokens_map.json").write_text(json.dumps({
        "unk_token": pieces[UNK_ID], "eos_token": pieces[EOS_ID],
        "pad_token": pieces[PAD_ID]}, indent=2), encoding="utf-8")


def export_hf(checkpoint: Path, output: Path, force: bool = False) -> Path:
    """Write the transformers directory `output` for `checkpoint`; returns `output`.

    Raises UsageError (transformers missing, existing output without `force`, a model
    Marian cannot express), DataError/CheckpointError (unreadable checkpoint)."""
    output = check_output(output, force)
    transformers = import_transformers()
    exported = read_checkpoint(Path(checkpoint))
    check_expressible(exported.model)
    source, target = language_pair(exported)
    max_length = min(exported.model.config.max_positions, 512)
    with _quiet(transformers):
        model = transformers.MarianMTModel(marian_config(transformers, exported)).eval()
        missing, unexpected = model.load_state_dict(marian_state_dict(exported.model),
                                                    strict=False)
        if missing or unexpected:
            raise CheckpointError(f"{checkpoint}: the Marian mapping left out {missing} / "
                                  f"did not place {unexpected}; please report this")
        model.generation_config = generation_config(transformers, exported, max_length)
        with temp_dir(output.absolute().parent, output.name) as tmp:
            directory = tmp / "model"
            model.save_pretrained(directory, safe_serialization=True)
            write_tokenizer(directory, exported, source, target, max_length)
            (directory / "README.md").write_text(CARD.format(
                name=output.name, pair=f"{source or '?'} -> {target or '?'}",
                languages=f"language: [{source}, {target}]\n" if source and target else "",
                checkpoint=Path(checkpoint).name, story="\n".join(training_story(exported)),
                max_length=max_length), encoding="utf-8")
            replace_dir(directory, output, tmp)
    return output
