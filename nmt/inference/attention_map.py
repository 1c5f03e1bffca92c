"""Encoder-decoder attention maps of a finished translation (`nmt translate --attention`).

The map is computed AFTER the search, by teacher-forcing the chosen hypothesis through the
model's incremental decoder (nmt/inference/decoding.py) with `need_attention=True`: `init_state`,
then `decode_step` over [BOS] + hypothesis pieces, one step per output piece. Step i
predicts output piece i (the last step predicts EOS), so row i of the map is "where the
decoder looked while producing output piece i". This keeps the plot independent of the
search internals (beam reordering, early stopping, batching) and costs one extra decoder
pass per sentence, paid only when maps are asked for. PNGs (nmt/plot.py) are written
atomically, one per non-empty input line, named by the 1-based input line number.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import torch
from torch import Tensor

from nmt.data.vocab import Vocab
from nmt.errors import UsageError
from nmt.inference.decoding import decode_step, init_state
from nmt.inference.layer_step import encoder_layer
from nmt.inference.search import Hypothesis
from nmt.model.transformer import Transformer
from nmt.special_ids import BOS_ID, EOS_ID

HEAD_MODES = ("mean", "all")


def resolve_layer(model: Transformer, layer: int) -> int:
    """The decoder layer index in 0..L-1 for `layer` in -L..L-1 (-1 = last, as in Python);
    anything else is a usage error naming the valid range."""
    count = len(model.decoder)
    if not -count <= layer < count:
        raise UsageError(f"--attention-layer {layer} is out of range: the model has {count} "
                         f"decoder layers; give 0..{count - 1}, or -{count}..-1 from the top")
    return layer % count


def piece_labels(vocab: Vocab, ids: Sequence[int]) -> list[str]:
    """Display labels of piece ids followed by EOS: the sentencepiece pieces (▁ marks a
    word start, as in the model's own view of the text), then '</s>'."""
    return [*vocab.pieces(list(ids)), "</s>"]


def attention_maps(model: Transformer, vocab: Vocab, src_ids: Sequence[int],
                   hyp_ids: Sequence[int], layer: int, device: torch.device
                   ) -> tuple[Tensor, list[str], list[str]]:
    """Encoder-decoder attention of decoder layer `layer` for one translated sentence.

    `src_ids` and `hyp_ids` are piece ids WITHOUT EOS (as the search returns them; the
    source as it was translated, i.e. after any truncation). Returns (weights, source
    labels, target labels): weights is float32 on the CPU, shape (heads, tgt_len,
    src_len) with tgt_len = len(hyp_ids) + 1 and src_len = len(src_ids) + 1 (EOS on both
    sides); each row is a probability distribution over source positions. The model
    should be in eval mode (as `load_model` returns it), so no dropout touches the maps.
    """
    index = resolve_layer(model, layer)
    src = torch.tensor([[*src_ids, EOS_ID]], dtype=torch.long, device=device)  # (1, src_len)
    tgt_in = torch.tensor([BOS_ID, *hyp_ids], dtype=torch.long, device=device)  # (tgt_len,)
    rows: list[Tensor] = []
    with torch.inference_mode():
        state = init_state(model, model.encode(src, has_pad=False, layer_step=encoder_layer),
                           attention_layer=index)
        for token in tgt_in:
            decode_step(model, token.view(1), state, need_attention=True)  # token (1,)
            assert state.attention is not None
            rows.append(state.attention[0].float().cpu())  # (heads, src_len)
    weights = torch.stack(rows, dim=1)  # (heads, tgt_len, src_len)
    return weights, piece_labels(vocab, src_ids), piece_labels(vocab, hyp_ids)


class AttentionWriter:
    """Writes DIR/{line:06d}.png for each translated line: the attention map of one
    decoder layer, averaged over heads ("mean") or one panel per head ("all").

    Called by `translate_stream` with (1-based line number, source ids as translated,
    best hypothesis). With an ensemble, the maps are those of the first model: the
    members may differ in heads and layers, so their attentions do not average.
    """

    def __init__(self, model: Transformer, vocab: Vocab, out_dir: Path, layer: int = -1,
                 heads: str = "mean", device: torch.device | None = None) -> None:
        if heads not in HEAD_MODES:
            raise UsageError(f"unknown --attention-heads {heads!r}; choose one of: "
                             f"{', '.join(HEAD_MODES)}")
        self.layer = resolve_layer(model, layer)
        out_dir = Path(out_dir)
        if out_dir.exists() and not out_dir.is_dir():
            raise UsageError(f"--attention {out_dir}: exists and is not a directory; "
                             "give a directory for the PNGs")
        try:
            out_dir.mkdir(parents=True, exist_ok=True)
        except OSError as err:
            raise UsageError(f"--attention {out_dir}: cannot create the directory "
                             f"({err.strerror or err})") from None
        self.model, self.vocab, self.out_dir, self.heads = model, vocab, out_dir, heads
        self.device = device if device is not None else next(model.parameters()).device
        from nmt.plot import require_matplotlib

        require_matplotlib()  # fail before translating, not at the first PNG

    def path(self, line_no: int) -> Path:
        """The PNG of input line `line_no` (1-based)."""
        return self.out_dir / f"{line_no:06d}.png"

    def __call__(self, line_no: int, src_ids: Sequence[int], hyp: Hypothesis) -> Path:
        """Compute and write the map of one line; returns the PNG's path."""
        from nmt.plot import write_attention_png

        weights, src_labels, tgt_labels = attention_maps(
            self.model, self.vocab, src_ids, hyp.tokens, self.layer, self.device)
        title = (f"line {line_no}: encoder-decoder attention, decoder layer "
                 f"{self.layer + 1}/{len(self.model.decoder)}")
        path = self.path(line_no)
        write_attention_png(path, weights.numpy(), src_labels, tgt_labels, self.heads, title)
        return path
