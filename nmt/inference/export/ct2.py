"""Export an nmt checkpoint as a CTranslate2 model directory (needs `pip install 'nmt[ct2]'`).

The weights are mapped one to one onto `ctranslate2.specs.TransformerSpec` (the way
CTranslate2's own fairseq and OpenNMT-py converters fill it), and `Converter.convert`
quantizes and writes `model.bin`, `config.json` and `shared_vocabulary.json`:
- post-norm or pre-norm (with the final LayerNorm of each stack), ReLU feed-forward,
  LayerNorm epsilon 1e-5 (torch's default, which nmt uses);
- fused projections as CTranslate2 wants them: self-attention Q|K|V in one matrix (nmt's
  `qkv` already is), encoder-decoder attention Q, then K|V fused (nmt's `q` and `kv`);
- one embedding matrix for source, target and output projection (CTranslate2 stores it
  once, as aliases), scaled by sqrt(d_model) on input (`scale_embeddings`);
- explicit position tables for the encoder and the decoder: CTranslate2's built-in
  sinusoids put sines and cosines in two halves, nmt interleaves them (nmt/model/layers.py), so
  the table is always written (learned tables as they are);
- the vocabulary is the sentencepiece pieces in id order, so token i is id i; nmt's
  special pieces become CTranslate2's unk/bos/eos tokens, decoding starts from BOS (nmt's
  decoder input is [BOS] + pieces) and the source gets EOS appended (`add_source_eos`),
  as nmt's sources are pieces + [EOS].
The sentencepiece model is copied beside it as `sentencepiece.model`, with a README.md on
how to run it. The directory is written under a temporary name and renamed when complete.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from nmt.data.shortlist import Shortlist
from nmt.data.vocab import BOS_ID, EOS_ID, UNK_ID, Vocab
from nmt.errors import CheckpointError, DataError, UsageError
from nmt.inference.export.common import (
    check_output,
    read_checkpoint,
    replace_dir,
    temp_dir,
    training_story,
)

QUANTIZATIONS = ("float32", "int8", "int8_float32", "int8_float16", "int8_bfloat16", "int16",
                 "float16", "bfloat16")
INSTALL_HINT = ("ctranslate2 is not installed; install it with: pip install 'nmt[ct2]' "
                "(or pip install ctranslate2)")
LAYER_NORM_EPSILON = 1e-5  # torch.nn.LayerNorm's default, which nmt's layers use

USAGE = """# CTranslate2 model exported by `nmt export ct2`

From {checkpoint}; weights stored as {quantization}.

{story}

```python
import ctranslate2, sentencepiece as spm

sp = spm.SentencePieceProcessor(model_file="{name}/sentencepiece.model")
translator = ctranslate2.Translator("{name}", device="cpu", compute_type="default")
pieces = sp.encode(["A dog runs on the beach."], out_type=str)
results = translator.translate_batch(pieces, beam_size=4, length_penalty=0.6,
                                     max_decoding_length=256, min_decoding_length=1)
print(sp.decode(results[0].hypotheses[0]))
```

CTranslate2 appends EOS to the source and starts decoding from BOS itself: pass the
sentencepiece pieces only. Its length penalty divides by length ** alpha (nmt's by GNMT's
((5 + length) / 6) ** alpha), so a few beam outputs may differ from `nmt translate`.
`compute_type="int8"` (or exporting with `--quantization int8`) runs int8 matmuls.
"""


def import_ctranslate2() -> Any:
    """The ctranslate2 module, or a UsageError that says how to install it."""
    try:
        import ctranslate2
    except ImportError as err:
        raise UsageError(INSTALL_HINT) from err
    return ctranslate2


def _np(t: torch.Tensor) -> Any:
    """A float32 numpy copy of a tensor (CTranslate2's specs take numpy arrays)."""
    return t.detach().float().cpu().contiguous().numpy().copy()


def build_spec(model: Any, vocab: Vocab) -> Any:
    """A filled `ctranslate2.specs.TransformerSpec` for an nmt Transformer and vocabulary."""
    import_ctranslate2()  # a UsageError naming the install command when missing
    from ctranslate2.specs import common_spec, transformer_spec

    cfg = model.config
    if cfg.head_dim_k != cfg.head_dim_v:
        raise UsageError(f"d_k {cfg.head_dim_k} != d_v {cfg.head_dim_v}: CTranslate2 needs "
                         "one head size for keys and values")
    head_dim = None if cfg.heads * cfg.head_dim_k == cfg.d_model else cfg.head_dim_k
    common = dict(pre_norm=cfg.pre_norm, activation=common_spec.Activation.RELU,
                  head_dim=head_dim)
    encoder = transformer_spec.TransformerEncoderSpec(cfg.encoder_layers, cfg.heads, **common)
    decoder = transformer_spec.TransformerDecoderSpec(cfg.decoder_layers, cfg.heads, **common)
    spec = transformer_spec.TransformerSpec(encoder, decoder)

    embed = _np(model.embed.weight)  # (vocab, d_model): source, target and output
    encoder.embeddings[0].weight = embed
    decoder.embeddings.weight = embed
    decoder.projection.weight = embed
    encoder.scale_embeddings = True  # sqrt(d_model), nmt/model/layers.py embedding_scale
    decoder.scale_embeddings = True
    encoder.position_encodings.encodings = _positions(model.enc_positions)
    decoder.position_encodings.encodings = _positions(model.dec_positions)
    for layer_spec, layer in zip(encoder.layer, model.encoder, strict=True):
        _attention(layer_spec.self_attention, layer.self_attn.qkv, layer.self_attn.out,
                   layer.res_attn.norm)
        _ffn(layer_spec.ffn, layer.ffn, layer.res_ffn.norm)
    for layer_spec, layer in zip(decoder.layer, model.decoder, strict=True):
        _attention(layer_spec.self_attention, layer.self_attn.qkv, layer.self_attn.out,
                   layer.res_self.norm)
        _linear(layer_spec.attention.linear[0], layer.cross_attn.q)
        _linear(layer_spec.attention.linear[1], layer.cross_attn.kv)  # K|V fused
        _linear(layer_spec.attention.linear[2], layer.cross_attn.out)
        _norm(layer_spec.attention.layer_norm, layer.res_cross.norm)
        _ffn(layer_spec.ffn, layer.ffn, layer.res_ffn.norm)
    if cfg.pre_norm:
        _norm(encoder.layer_norm, model.enc_norm)
        _norm(decoder.layer_norm, model.dec_norm)

    pieces = [vocab.pieces([i])[0] for i in range(len(vocab))]
    if len(set(pieces)) != len(pieces):
        raise DataError("the sentencepiece model has duplicate pieces; CTranslate2 maps "
                        "tokens by their text")
    spec.register_source_vocabulary(pieces)
    spec.register_target_vocabulary(pieces)
    spec.config.unk_token = pieces[UNK_ID]
    spec.config.bos_token = pieces[BOS_ID]
    spec.config.eos_token = pieces[EOS_ID]
    spec.config.decoder_start_token = pieces[BOS_ID]
    spec.config.add_source_eos = True
    spec.config.layer_norm_epsilon = LAYER_NORM_EPSILON
    return spec


def _positions(positions: Any) -> Any:
    """(max_positions, d_model) table: the learned one, or nmt's interleaved sinusoids."""
    if positions.learned is not None:
        return _np(positions.learned.weight)
    return _np(positions.table)


def _linear(spec: Any, linear: torch.nn.Linear) -> None:
    spec.weight = _np(linear.weight)
    if linear.bias is not None:
        spec.bias = _np(linear.bias)


def _norm(spec: Any, norm: torch.nn.LayerNorm) -> None:
    spec.gamma = _np(norm.weight)
    spec.beta = _np(norm.bias)


def _attention(spec: Any, qkv: torch.nn.Linear, out: torch.nn.Linear,
               norm: torch.nn.LayerNorm) -> None:
    _linear(spec.linear[0], qkv)  # Q|K|V fused, in that order
    _linear(spec.linear[1], out)
    _norm(spec.layer_norm, norm)


def _ffn(spec: Any, ffn: Any, norm: torch.nn.LayerNorm) -> None:
    _linear(spec.linear_0, ffn.fc1)
    _linear(spec.linear_1, ffn.fc2)
    _norm(spec.layer_norm, norm)


def vocabulary_map(shortlist: Shortlist, vocab: Vocab) -> str:
    """The shortlist as CTranslate2's vocabulary map (its `use_vmap`): a line per source
    piece, `piece<TAB>candidate candidate ...`, and one with an empty source for the pieces
    that are always candidates."""
    pieces = vocab.pieces(range(len(vocab)))
    lines = ["\t" + " ".join(pieces[i] for i in shortlist.frequent)]
    for source, row in enumerate(shortlist.table):
        targets = [pieces[i] for i in row if i >= 0]
        if targets:
            lines.append(f"{pieces[source]}\t{' '.join(targets)}")
    return "\n".join(lines) + "\n"


def export_ct2(checkpoint: Path, output: Path, quantization: str = "float32",
               force: bool = False, shortlist: Path | None = None) -> Path:
    """Write the CTranslate2 directory `output` for `checkpoint`; returns `output`. With
    `shortlist` (a file of `nmt shortlist`) the directory also holds it as CTranslate2's
    vocabulary map (translate with `use_vmap=True`).

    Raises UsageError (bad quantization, existing output without `force`, ctranslate2
    missing), DataError/CheckpointError (unreadable checkpoint or shortlist)."""
    if quantization not in QUANTIZATIONS:
        raise UsageError(f"unknown --quantization {quantization!r}; choose one of: "
                         f"{', '.join(QUANTIZATIONS)}")
    output = check_output(output, force)
    ct2 = import_ctranslate2()
    exported = read_checkpoint(Path(checkpoint))
    model, vocab = exported.model, exported.vocab
    spec = build_spec(model, vocab)

    class _Spec(ct2.converters.Converter):
        def _load(self) -> Any:
            return spec

    listed = None if shortlist is None else Shortlist.load(shortlist, len(vocab))
    with temp_dir(output.absolute().parent, output.name) as tmp:
        model_dir = tmp / "model"
        vmap = None
        if listed is not None:
            vmap = tmp / "vmap.txt"
            vmap.write_text(vocabulary_map(listed, vocab), encoding="utf-8")
        try:
            _Spec().convert(str(model_dir), quantization=quantization,
                            vmap=None if vmap is None else str(vmap))
        except (ValueError, RuntimeError, NotImplementedError) as err:
            raise CheckpointError(f"{checkpoint}: CTranslate2 conversion failed: "
                                  f"{str(err).splitlines()[0] if str(err) else err!r}") from err
        (model_dir / "sentencepiece.model").write_bytes(vocab.proto)
        (model_dir / "README.md").write_text(USAGE.format(
            checkpoint=Path(checkpoint).name, story="\n".join(training_story(exported)),
            quantization=quantization, name=output.name), encoding="utf-8")
        replace_dir(model_dir, output, tmp)
    return output
