"""The lexical shortlist (`nmt shortlist`, `nmt translate --shortlist`): what it learns, its
file, and a search over its columns that equals the full vocabulary's where the shortlist
holds every piece."""

from __future__ import annotations

import io
from pathlib import Path

import numpy as np
import pytest

from nmt.config import DecodeConfig
from nmt.data.shortlist import SPECIALS, Shortlist, learn_shortlist
from nmt.errors import DataError
from nmt.inference.translate import Engine, translate_stream

pytestmark = pytest.mark.usefixtures("one_thread")


def flat(lines: list[list[int]]) -> tuple[np.ndarray, np.ndarray]:
    tokens = np.array([i for line in lines for i in line], dtype=np.uint16)
    offsets = np.concatenate([[0], np.cumsum([len(line) for line in lines])]).astype(np.int64)
    return tokens, offsets


def test_ibm1_learns_which_piece_translates_which() -> None:
    """Source 10 always meets target 20, 11 meets 21; both meet the frequent 30. EM gives
    each source its own translation first, though 30 co-occurs as often."""
    src = [[10, 12], [11, 12], [10, 13], [11, 13]] * 10
    tgt = [[20, 30], [21, 30], [20, 30], [21, 30]] * 10
    shortlist = learn_shortlist(*flat(src), *flat(tgt), vocab_size=40, per_source=2,
                                frequent=1)
    assert shortlist.table[10, 0] == 20 and shortlist.table[11, 0] == 21
    assert set(shortlist.table[10]) == {20, 30} and set(shortlist.table[5]) == {-1}
    assert shortlist.frequent.tolist() == [30]
    columns = shortlist.candidates([[10], [10, 39]])  # 39: never seen, nothing added
    assert columns.tolist() == [*SPECIALS.tolist(), 20, 30]


def test_a_large_corpus_is_subsampled_within_the_event_budget() -> None:
    src = [[10, 11, 12]] * 1000
    tgt = [[20, 21]] * 1000
    shortlist = learn_shortlist(*flat(src), *flat(tgt), vocab_size=30, per_source=2,
                                frequent=2, max_events=600)  # 6,000 events: every 10th pair
    assert set(shortlist.table[10]) == {20, 21}


def test_the_file_round_trips_and_names_a_wrong_vocabulary(tmp_path: Path) -> None:
    shortlist = learn_shortlist(*flat([[5, 6]]), *flat([[7, 8]]), vocab_size=9, per_source=3,
                                frequent=1)
    path = tmp_path / "s.npz"
    shortlist.save(path)
    again = Shortlist.load(path, vocab_size=9)
    assert np.array_equal(again.table, shortlist.table) and again.vocab_size == 9
    with pytest.raises(DataError, match="vocabulary of 9 pieces, the model has 10"):
        Shortlist.load(path, vocab_size=10)
    (tmp_path / "bad.npz").write_bytes(b"not a zip")
    with pytest.raises(DataError, match="bad.npz: unreadable shortlist"):
        Shortlist.load(tmp_path / "bad.npz")


def everything(vocab_size: int, path: Path) -> Path:
    """A shortlist whose candidates are the whole vocabulary."""
    table = np.tile(np.arange(vocab_size, dtype=np.int32), (vocab_size, 1))
    Shortlist(table, np.arange(4, dtype=np.int32), vocab_size).save(path)
    return path


@pytest.mark.parametrize("settings", [
    dict(), dict(nbest=3, beam=3), dict(sampling=True, nbest=2), dict(prefixes=True)])
def test_a_shortlist_of_every_piece_decodes_as_the_full_vocabulary(
        tiny_checkpoint: Path, tmp_path: Path, settings: dict) -> None:
    """The column plumbing (ids <-> columns for the decoder's input, the projection's rows,
    prefixes and the hypotheses) changes nothing when the columns are every id."""
    from conftest import shared_data_path

    lines = shared_data_path("multi30k", "test_2016_flickr.en").read_text(
        encoding="utf-8").split("\n")[:60]
    prefixes = settings.pop("prefixes", False)
    cfg = DecodeConfig(max_len_b=6, max_tokens=128, buffer_size=30, **settings)
    plain = Engine.load([tiny_checkpoint], cfg, device="cpu", precision="fp32", seed=3)
    path = everything(len(plain.vocab), tmp_path / "all.npz")
    listed = Engine.load([tiny_checkpoint], cfg, device="cpu", precision="fp32", seed=3,
                             shortlist=path)
    data = ("\n".join(lines) + "\n").encode()
    prefix = ("\n".join("Ein" if i % 3 == 0 else "" for i in range(len(lines))) + "\n").encode()
    outputs = []
    for translator in (plain, listed):
        sink = io.BytesIO()
        translate_stream(io.BytesIO(data), sink, translator,
                         prefix_source=io.BytesIO(prefix) if prefixes else None)
        outputs.append(sink.getvalue())
    assert outputs[0] == outputs[1] and outputs[0].count(b"\n") >= len(lines)


def test_translate_with_a_learned_shortlist(tiny_checkpoint: Path, tmp_path: Path,
                                            nmt_cli) -> None:
    """`nmt shortlist` on a binarized DATA dir, then `nmt translate --shortlist`: one line
    per line; a shortlist of another vocabulary is a one-line error (exit 3)."""
    from helpers.data import multi30k_data

    data = multi30k_data(tmp_path / "data", n_train=300, n_valid=20, vocab_size=500)
    made = nmt_cli.invoke("shortlist", str(data), "--per-source", "5", "--frequent", "20")
    assert made.returncode == 0, made.err
    assert (data / "shortlist.npz").is_file() and "300 training pairs" in made.err
    wrong = nmt_cli.invoke("translate", "-m", str(tiny_checkpoint), "--shortlist",
                           str(data / "shortlist.npz"), input=b"a dog\n")
    assert wrong.returncode == 3 and "made for a vocabulary of" in wrong.err
    assert len(wrong.err.strip().splitlines()) == 1
    own = everything(600, tmp_path / "own.npz")  # the tiny checkpoint's 600 pieces
    result = nmt_cli.invoke("translate", "-m", str(tiny_checkpoint), "--shortlist", str(own),
                            "--max-len-b", "5", input=b"a dog\n\ntwo men\n")
    assert result.returncode == 0, result.err
    assert result.stdout.count(b"\n") == 3


def test_a_step_over_columns_is_the_full_step_at_those_ids(
        tiny_checkpoint: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The decoder over a shortlist's columns feeds the columns' ids and scores only their
    rows of the output projection: its logits are the full ones at those ids, except PAD's
    column, which also holds the estimated mass of the pieces left out (how near that
    brings the full log-probabilities: tests/inference/test_rest_mass.py); with
    NMT_SHORTLIST_REST=0 the full logits exactly. translate_ids hands back ids, never
    columns."""
    import torch

    from nmt.inference.decoding import ModelStepDecoder

    translator = Engine.load([tiny_checkpoint], DecodeConfig(max_len_b=5), device="cpu",
                                 precision="fp32")
    model, workspace = translator.models[0], translator.workspaces[0]
    columns = torch.cat([torch.arange(4), torch.arange(300, 600, 3)])  # specials, then some
    src = torch.tensor([[17, 42, 99, 2], [5, 8, 2, 0]])  # EOS 2, PAD 0
    for rest in ("1", "0"):
        monkeypatch.setenv("NMT_SHORTLIST_REST", rest)
        tokens_cols = torch.tensor([1, 1])  # BOS
        with torch.inference_mode():
            full = ModelStepDecoder(model, src, workspace)
            listed = ModelStepDecoder(model, src, workspace, columns=columns)
            assert (listed.rest is None) == (rest == "0")
            for step in range(3):
                every = full.step(columns[tokens_cols]).clone()  # (2, vocab)
                want = every[:, columns]
                got = listed.step(tokens_cols)
                if rest == "0":
                    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
                else:
                    torch.testing.assert_close(got[:, 1:], want[:, 1:], rtol=1e-5, atol=1e-5)
                    assert bool((got[:, 0] > want[:, 0]).all())  # PAD: plus the rest
                tokens_cols = torch.tensor([4 + step, 10 + step])  # any columns
    path = tmp_path / "subset.npz"
    Shortlist(np.tile(columns[4:].numpy().astype(np.int32), (600, 1)),
              np.arange(4, dtype=np.int32), 600).save(path)
    listed_tr = Engine.load([tiny_checkpoint], DecodeConfig(max_len_b=5), device="cpu",
                                precision="fp32", shortlist=path)
    allowed = set(columns.tolist())
    for hyps in listed_tr.translate_ids([[17, 42, 99], [5, 8], [300]]):
        assert hyps and set(hyps[0].tokens) <= allowed and hyps[0].tokens
