"""Joint sentencepiece vocabulary: special ids, training, encoding and decoding.

The special ids are defined here and nowhere else. Sequences follow one convention:
source = pieces + [EOS]; decoder input = [BOS] + pieces; decoder output = pieces + [EOS].
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import sentencepiece as spm

from nmt.errors import DataError

PAD_ID = 0
UNK_ID = 1
BOS_ID = 2
EOS_ID = 3


class Vocab:
    """A sentencepiece model held as bytes, so checkpoints can carry it whole."""

    def __init__(self, model_proto: bytes) -> None:
        self.proto = bytes(model_proto)
        self._sp = spm.SentencePieceProcessor()
        try:
            self._sp.LoadFromSerializedProto(self.proto)
        except Exception as err:  # sentencepiece raises RuntimeError/OSError variants
            raise DataError(f"invalid sentencepiece model: {err}") from err
        if (self._sp.pad_id(), self._sp.unk_id(), self._sp.bos_id(), self._sp.eos_id()) != (
                PAD_ID, UNK_ID, BOS_ID, EOS_ID):
            raise DataError("sentencepiece model has unexpected special ids; "
                            f"expected pad={PAD_ID} unk={UNK_ID} bos={BOS_ID} eos={EOS_ID}, "
                            "retrain it with `nmt bpe`")

    @classmethod
    def from_file(cls, path: Path) -> Vocab:
        """Load a `.model` file written by `nmt bpe`."""
        try:
            return cls(Path(path).read_bytes())
        except OSError as err:
            raise DataError(f"{path}: cannot read sentencepiece model ({err.strerror}); "
                            "run `nmt bpe` first") from err

    def __len__(self) -> int:
        return self._sp.get_piece_size()

    def encode(self, lines: Sequence[str], num_threads: int = -1) -> list[list[int]]:
        """Piece ids of each line (no BOS/EOS added)."""
        return self._sp.encode(list(lines), out_type=int, num_threads=num_threads)

    def decode(self, ids: Sequence[Sequence[int]]) -> list[str]:
        """Detokenized text of each id sequence; special ids are dropped."""
        cleaned = [[i for i in seq if i > EOS_ID] for seq in ids]
        return self._sp.decode(cleaned)

    def pieces(self, ids: Sequence[int]) -> list[str]:
        """Surface pieces of one id sequence (for attention plots and debugging)."""
        return [self._sp.id_to_piece(int(i)) for i in ids]
