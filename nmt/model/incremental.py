"""The one interface between the network and incremental decoding's caches.

A decoder layer's `incremental` call sees its part of the decoding state as a `LayerCache`:
it writes this position's self-attention key/value, reads back the keys/values to attend
over, and reads the encoder's K/V. How the history is laid out (grouped per sentence, slots, masks,
or plain per-row tensors) is the cache's business, in nmt/inference; the network only
follows one convention, "rows per entry":

The n rows decoded side by side are folded as (entries, n // entries) queries: the cache
hands back keys of shape (entries, heads, length, d) and the n rows are entries * g
consecutive queries, g = n // entries, so rows that share a history (a sentence's beam)
read it from memory once. A plain cache has one entry per row (g = 1).
"""

from __future__ import annotations

from typing import Protocol

from torch import Tensor


class LayerCache(Protocol):
    """One decoder layer's view of the decoding state for the current step."""

    @property
    def rows(self) -> int:
        """n, the rows the caches hold (finished ones included)."""
        ...

    @property
    def live(self) -> Tensor | None:
        """(m,) indices of the rows fed this step, or None when all n are: the other rows
        are finished for good and get zero queries, keys and values (their output is
        dropped), so their projections are never computed."""
        ...

    @property
    def entries(self) -> Tensor | None:
        """(e,) long: the entries whose rows are fed this step, when `live` is a whole
        number of entries in order (each entry's g rows consecutive, m = e * g); None when
        all rows are fed or the cache cannot say. Then a layer may feed only those: queries
        of the m rows, `write_live`, and attention over entries `entries` of the history
        (finished sentences stay in the caches untouched, costing nothing)."""
        ...

    def write_live(self, k: Tensor, v: Tensor) -> None:
        """Store this position's self-attention key (m, heads, d_k) and value (m, heads,
        d_v) of the fed rows only (`live`, in its order; only when `entries` is not None);
        the other rows' slots at this position are left as they are (never read)."""
        ...

    def write(self, k: Tensor, v: Tensor) -> None:
        """Store this position's self-attention key (n, heads, d_k) and value
        (n, heads, d_v) of every row."""
        ...

    def history(self) -> tuple[Tensor, Tensor, Tensor | None]:
        """The self-attention keys (entries, heads, length, d_k) and values (entries,
        heads, length, d_v) the rows attend over, this position included, and a mask None,
        boolean (True = may attend) or additive (0 / -inf; see nmt/model/attention.py
        `apply_mask_`), broadcastable to (entries, heads, g, length)."""
        ...

    def encoder(self) -> tuple[Tensor, Tensor, Tensor | None]:
        """The encoder-decoder attention's keys, TRANSPOSED (entries, heads, d_k, src_len),
        as the scores' matmul reads them, V (entries, heads, src_len, d_v), and the source
        mask None or (entries, 1, 1, src_len), boolean (True = real token) or additive;
        rows per entry as for `history`."""
        ...
