"""`nmt bpe DATA --spm-from MODEL.pt`: new data encoded with the vocabulary inside a
checkpoint, so a fine-tuned model's ids match its parent's. Real Multi30k text:
the parent's vocabulary from one part of the training set, the new data from another."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from conftest import shared_data_path
from helpers.checkpoints import RunsCode, make_checkpoint, make_vocab

from nmt.checkpoint import FORMAT
from nmt.data.bpe import BpeConfig, run_bpe
from nmt.data.dataset import ParallelData, load_vocab
from nmt.data.vocab import Vocab
from nmt.errors import UsageError


def _data_dir(out: Path, multi30k: Path, start: int, stop: int) -> Path:
    """A DATA dir (no manifest): Multi30k train lines [start, stop) and val."""
    out.mkdir(parents=True)
    for lang, side in (("en", "src"), ("de", "tgt")):
        lines = (multi30k / f"train.{lang}").read_text("utf-8").split("\n")[start:stop]
        (out / f"train.{side}").write_text("".join(x + "\n" for x in lines), "utf-8")
        shutil.copyfile(multi30k / f"val.{lang}", out / f"valid.{side}")
    return out


@pytest.fixture(scope="module")
def parent(tmp_path_factory):
    """(checkpoint, its sentencepiece model) learnt on Multi30k train lines 0..1500."""
    root = tmp_path_factory.mktemp("parent")
    model = make_vocab(shared_data_path("multi30k"), root, lines=1500, size=600)
    return make_checkpoint(model, root / "parent.pt"), model


def test_new_data_gets_the_parent_ids(tmp_path, parent, multi30k_dir):
    checkpoint, spm_model = parent
    data = _data_dir(tmp_path / "child", multi30k_dir, 20000, 21500)
    messages: list[str] = []
    meta = run_bpe(data, BpeConfig(spm_from=checkpoint, threads=1), report=messages.append)
    assert (data / "spm.model").read_bytes() == spm_model.read_bytes()
    assert any("not trained" in m for m in messages)
    assert meta["vocab_size"] == 600 and meta["vocab_settings"]["spm_from"] == \
        str(checkpoint.resolve())
    lines = (data / "train.tgt").read_text("utf-8").split("\n")[:-1]
    pairs = ParallelData.open(data, "train")
    expected = Vocab(spm_model.read_bytes()).encode(lines)
    assert [pairs.tgt[i].tolist() for i in range(len(lines))] == expected
    assert len(load_vocab(data)) == 600
    assert (data / "spm.vocab").read_text("utf-8").split("\n")[3].startswith("</s>\t")

    # Again: nothing to do. From the .model file itself: the same model, no re-encoding.
    stamp = (data / "bin" / "train.tgt.tokens.npy").stat().st_mtime_ns
    messages.clear()
    assert run_bpe(data, BpeConfig(spm_from=checkpoint, threads=1),
                   report=messages.append)["splits"] == meta["splits"]
    assert any("up to date" in m for m in messages)
    run_bpe(data, BpeConfig(spm_from=spm_model, threads=1))
    assert (data / "bin" / "train.tgt.tokens.npy").stat().st_mtime_ns == stamp
    with pytest.raises(UsageError, match="--vocab-size and --spm-from exclude each other"):
        BpeConfig(spm_from=checkpoint, vocab_size=600)


def test_bad_or_unsafe_checkpoints_are_one_line_exit_6(tmp_path, parent, multi30k_dir, nmt_cli):
    checkpoint, spm_model = parent
    data = _data_dir(tmp_path / "child", multi30k_dir, 20000, 20100)
    marker = tmp_path / "code_ran"
    evil = tmp_path / "evil.pt"
    torch.save({"format": FORMAT, "step": 1, "model_config": {}, "model": {},
                "vocab": RunsCode(f"touch {marker}")}, evil)
    garbage = tmp_path / "garbage.pt"
    garbage.write_bytes(b"not a checkpoint at all")
    no_spm = tmp_path / "no_spm.pt"
    payload = torch.load(checkpoint, weights_only=True)
    torch.save({**payload, "vocab": b"not a sentencepiece model"}, no_spm)
    for bad, words in ((evil, ["refused to load"]), (garbage, ["refused to load"]),
                       (no_spm, ["invalid sentencepiece model"])):
        run = nmt_cli.invoke("bpe", data, "--spm-from", bad)
        assert run.returncode == 6, run.err
        lines = run.err.splitlines()
        assert len(lines) == 1 and lines[0].startswith(f"nmt bpe: error: {bad}"), run.err
        assert all(w in lines[0] for w in words) and "Traceback" not in run.err
    assert not marker.exists()  # the pickled command never ran
    assert not (data / "spm.model").exists()
    bad_model = tmp_path / "bad.model"
    bad_model.write_bytes(b"junk")
    run = nmt_cli.invoke("bpe", data, "--spm-from", bad_model)
    assert run.returncode == 3 and "bad.model" in run.err, run.err
    run = nmt_cli.invoke("bpe", data, "--spm-from", checkpoint, "--vocab-size", "100")
    assert run.returncode == 2 and "exclude each other" in run.err
