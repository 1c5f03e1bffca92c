"""Joint sentencepiece vocabulary: training, encoding and decoding.

The special ids are defined in `nmt.special_ids` (re-exported here). Sequences follow one
convention: source = pieces + [EOS]; decoder input = [BOS] + pieces; decoder output =
pieces + [EOS].
"""

from __future__ import annotations

import re
import tempfile
from collections.abc import Sequence
from pathlib import Path

import sentencepiece as spm

from nmt.errors import DataError, UsageError
from nmt.fileio import atomic_write_bytes
from nmt.special_ids import BOS_ID, EOS_ID, PAD_ID, UNK_ID

__all__ = ["BOS_ID", "EOS_ID", "NORMALIZATION", "PAD_ID", "UNK_ID", "Vocab", "train_vocab",
           "unicode_text"]

_SURROGATES = re.compile("[\ud800-\udfff]")


def unicode_text(text: str) -> str:
    """`text` with every surrogate code point (a Python str and a JSON string may hold a
    lone one; no UTF-8 can, and sentencepiece refuses it with a TypeError) replaced by
    U+FFFD, as input files' invalid UTF-8 is under `--errors replace`."""
    return _SURROGATES.sub("\ufffd", text)


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
        """Piece ids of each line (no BOS/EOS added); surrogates count as U+FFFD
        (`unicode_text`)."""
        return self._sp.encode([unicode_text(line) for line in lines], out_type=int,
                               num_threads=num_threads)

    def decode(self, ids: Sequence[Sequence[int]], num_threads: int = -1) -> list[str]:
        """Detokenized text of each id sequence; special ids are dropped.

        sentencepiece starts `num_threads` threads per call (-1: one per core), which costs
        about a millisecond: pass 1 for a few sequences at a time (translate's buffers).
        """
        cleaned = [[i for i in seq if i > EOS_ID] for seq in ids]
        return self._sp.decode(cleaned, num_threads=num_threads)

    def pieces(self, ids: Sequence[int]) -> list[str]:
        """Surface pieces of one id sequence (for attention plots and debugging)."""
        return [self._sp.id_to_piece(int(i)) for i in ids]


# How `train_vocab` normalizes text. "identity": sentencepiece keeps every character as it
# is (it only drops leading/trailing spaces and collapses runs of spaces, which prep's
# whitespace cleanup makes a no-op), so decode(encode(line)) gives the line back and
# the binarized data is a lossless view of what `nmt prep` wrote. Unicode/punctuation
# normalization is prep's job (Moses rules on training data only); sentencepiece's default
# nmt_nfkc would also rewrite dev/test sources (full-width forms, ligatures, ...) silently.
NORMALIZATION = "identity"

_SIZE_HINTS = ("Vocabulary size too high", "Vocabulary size is smaller than required_chars")


def _sample_lines(inputs: Sequence[Path], sample: int, seed: int, out: Path) -> bool:
    """Write `sample` lines drawn uniformly without replacement from all `inputs` to `out`
    (in corpus order); False, writing nothing, when the inputs hold no more than that.

    Done here rather than by sentencepiece's own sampling because that one draws from a
    process-wide generator: two trainings in one process would differ.
    """
    import numpy as np

    from nmt.fileio import count_lines

    counts = [count_lines(Path(p)) for p in inputs]
    total = sum(counts)
    if total <= sample:
        return False
    rng = np.random.default_rng(seed)
    chosen = np.sort(rng.choice(total, size=sample, replace=False)).tolist() + [total]
    position, pick = 0, 0
    with open(out, "wb") as sink:
        for path in inputs:
            with open(path, "rb") as source:
                for line in source:
                    if chosen[pick] == position:
                        sink.write(line if line.endswith(b"\n") else line + b"\n")
                        pick += 1
                    position += 1
    return True


def train_vocab(inputs: Sequence[Path], model_path: Path, vocab_size: int, *,
                sample: int = 0, threads: int = 1, seed: int = 1) -> Vocab:
    """Learn one joint BPE model over all `inputs` and write it to `model_path` (.model,
    plus the human-readable .vocab beside it), atomically.

    `sample` > 0 trains on that many lines drawn with `seed` from all inputs together (how
    big corpora stay within memory); the same inputs, sample and seed give the same model.
    Byte fallback is on, so characters unseen in the (sampled) training text encode as
    UTF-8 bytes rather than UNK and still round-trip.
    Raises UsageError when `vocab_size` does not fit the data.
    """

    model_path = Path(model_path)
    model_path.parent.mkdir(parents=True, exist_ok=True)
    if vocab_size < 1:
        raise UsageError(f"vocabulary size must be positive, got {vocab_size}")
    for path in inputs:
        if not Path(path).is_file():
            raise DataError(f"{path}: no such file; run `nmt prep` first")
    options: dict[str, object] = dict(
        input=[str(p) for p in inputs], model_type="bpe", vocab_size=vocab_size,
        pad_id=PAD_ID, unk_id=UNK_ID, bos_id=BOS_ID, eos_id=EOS_ID,
        character_coverage=1.0, byte_fallback=True, normalization_rule_name=NORMALIZATION,
        num_threads=max(1, threads), minloglevel=2,
    )
    spm.set_random_generator_seed(seed)
    with tempfile.TemporaryDirectory(prefix=".spm-", dir=model_path.parent) as tmp:
        prefix = Path(tmp) / "spm"
        if sample > 0 and _sample_lines(inputs, sample, seed, Path(tmp) / "sample.txt"):
            options["input"] = [str(Path(tmp) / "sample.txt")]
        try:
            spm.SentencePieceTrainer.train(model_prefix=str(prefix), **options)
        except RuntimeError as err:
            message = str(err).strip().splitlines()[-1] if str(err).strip() else repr(err)
            if any(hint in message for hint in _SIZE_HINTS):
                detail = message.split("] ", 1)[-1]
                raise UsageError(f"--vocab-size {vocab_size} does not fit the training text "
                                 f"({detail}); choose a suitable --vocab-size") from err
            raise DataError(f"sentencepiece training on {', '.join(map(str, inputs))} "
                            f"failed: {message}") from err
        proto = prefix.with_suffix(".model").read_bytes()
        vocab_text = prefix.with_suffix(".vocab").read_bytes()
    vocab = Vocab(proto)
    atomic_write_bytes(model_path.with_suffix(".vocab"), lambda f: f.write(vocab_text))
    atomic_write_bytes(model_path, lambda f: f.write(proto))
    return vocab
