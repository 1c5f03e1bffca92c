"""Issue 16's training features on real Multi30k data with tiny models: the best checkpoint
and early stopping (exact across a kill -9 and resume), EMA of the weights (exact resume,
used by translate and average), fine-tuning with --init-from / --spm-from (the child's
valid loss starts where the parent's ended), mismatches as one line with exit 6, and
per-corpus sampling weights."""

from __future__ import annotations

import json
import shutil
import signal
import subprocess
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers.data import multi30k_data, write_text_data

from nmt.checkpoint import load_checkpoint
from nmt.config import TrainConfig, model_preset
from nmt.data.bpe import BpeConfig, run_bpe
from nmt.data.dataset import CorpusRange, ParallelData
from nmt.train.log import read_jsonl
from nmt.train.loop import train
from nmt.train.sampling import EpochBatches, corpus_counts

MODEL = model_preset("tiny", dropout=0.1)


def _pairs(multi30k: Path, split: str, start: int, stop: int) -> list[tuple[str, str]]:
    names = {"train": ("train.en", "train.de"), "valid": ("val.en", "val.de")}[split]
    src, tgt = ((multi30k / n).read_text(encoding="utf-8").splitlines()[start:stop]
                for n in names)
    return list(zip(src, tgt, strict=True))


@pytest.fixture(scope="module")
def m30k(tmp_path_factory) -> Path:
    """400 real Multi30k pairs (+40 valid), joint BPE 500."""
    return multi30k_data(tmp_path_factory.mktemp("m30k") / "data", n_train=400, n_valid=40,
                         vocab_size=500)


def _cfg(**overrides) -> TrainConfig:
    base = dict(max_updates=60, max_tokens=512, warmup=10, lr_scale=2.0, max_len=64,
                log_interval=5, valid_interval=5, save_interval_minutes=0,
                save_interval_updates=7, seed=4, precision="fp32", keep_last=50)
    return TrainConfig(**{**base, **overrides})


def _cli_flags(cfg: TrainConfig) -> list[str]:
    flags = ["--arch", "tiny", "--dropout", "0.1", "--device", "cpu"]
    for key in ("max_updates", "max_tokens", "warmup", "lr_scale", "max_len", "log_interval",
                "valid_interval", "save_interval_minutes", "save_interval_updates", "seed",
                "precision", "keep_last", "best_metric", "patience", "ema_decay"):
        flags += [f"--{key.replace('_', '-')}", str(getattr(cfg, key))]
    return flags



@pytest.mark.slow
def test_patience_and_best_file_survive_kill_and_resume(m30k, tmp_path, one_thread, nmt_cli):
    """kill -9 at several moments (between a best-file write and the next checkpoint
    included), resume each time: the run stops at the same update with the same best
    model as one never killed."""
    cfg = _cfg(max_updates=400, patience=3, ema_decay=0.9)
    whole = train(m30k, tmp_path / "whole", MODEL, cfg, "cpu", progress=False)
    assert whole.stopped_early and whole.step < 400, whole.step
    best = load_checkpoint(tmp_path / "whole" / "checkpoint_best.pt")
    # Run again on the finished run (or killed after its last save): it stays stopped; it
    # used to train on until the next validation, and past it when that one improved.
    again = train(m30k, tmp_path / "whole", MODEL, cfg, "cpu", progress=False)
    assert again.stopped_early and again.step == whole.step
    assert load_checkpoint(tmp_path / "whole" / "checkpoint_last.pt")["step"] == whole.step
    run = tmp_path / "killed"
    args = ["train", str(m30k), "-o", str(run), *_cli_flags(cfg)]
    kills = 0
    for wait in (0.5, 1.5, 3.0):
        with (tmp_path / "err.txt").open("w") as err:
            proc = nmt_cli.popen(*args, stdout=subprocess.DEVNULL, stderr=err)
            deadline = time.monotonic() + 120
            while "valid at update" not in (tmp_path / "err.txt").read_text():
                assert proc.poll() is None and time.monotonic() < deadline
                time.sleep(0.02)
            time.sleep(wait)
            if proc.poll() is None:
                proc.send_signal(signal.SIGKILL)
                kills += 1
            proc.wait()
    assert kills >= 1
    final = nmt_cli.run(*args, timeout=600)
    assert final.returncode == 0, final.err
    assert "early stop" in final.out + final.err
    assert load_checkpoint(run / "checkpoint_last.pt")["step"] == whole.step
    again = load_checkpoint(run / "checkpoint_best.pt")
    assert again["step"] == best["step"] and again["meta"]["best"] == best["meta"]["best"]
    for name, tensor in best["model"].items():
        torch.testing.assert_close(again["model"][name], tensor, rtol=0, atol=0)
    log = [r for r in read_jsonl(run / "train_log.jsonl") if r["kind"] == "valid"]
    assert [r["step"] for r in log] == list(range(5, whole.step + 1, 5))  # each once


def test_ema_resumes_exactly_and_is_what_translate_and_average_use(m30k, tmp_path,
                                                                   one_thread):
    from nmt.average import average_checkpoints
    from nmt.checkpoint import load_model

    cfg = _cfg(max_updates=12, ema_decay=0.95, save_interval_updates=6)
    train(m30k, tmp_path / "whole", MODEL, cfg, "cpu", progress=False)
    train(m30k, tmp_path / "split", MODEL, _cfg(max_updates=6, ema_decay=0.95,
                                                 save_interval_updates=6), "cpu",
          progress=False)
    train(m30k, tmp_path / "split", MODEL, cfg, "cpu", progress=False)
    a = load_checkpoint(tmp_path / "whole" / "checkpoint_last.pt")
    b = load_checkpoint(tmp_path / "split" / "checkpoint_last.pt")
    assert a["ema"]["updates"] == b["ema"]["updates"] == 12
    for name, tensor in a["ema"]["weights"].items():
        assert torch.equal(b["ema"]["weights"][name], tensor), name
        assert not torch.equal(a["model"][name], tensor)  # an average, not the weights
    path = tmp_path / "whole" / "checkpoint_last.pt"
    ema_model = load_model(path)[0]  # auto: the EMA weights
    raw_model = load_model(path, weights="raw")[0]
    name = "embed.weight"
    assert torch.equal(dict(ema_model.named_parameters())[name], a["ema"]["weights"][name])
    assert torch.equal(dict(raw_model.named_parameters())[name], a["model"][name])
    out = average_checkpoints([tmp_path / "whole" / "checkpoint_6.pt", path],
                              tmp_path / "avg.pt")
    assert out["weights"] == "ema"
    want = (a["ema"]["weights"][name].double() + load_checkpoint(
        tmp_path / "whole" / "checkpoint_6.pt")["ema"]["weights"][name].double()) / 2
    torch.testing.assert_close(load_checkpoint(tmp_path / "avg.pt")["model"][name],
                               want.float())
    best = load_checkpoint(tmp_path / "whole" / "checkpoint_best.pt")
    assert best["meta"]["best"]["ema"] is True


@pytest.mark.slow
def test_fine_tuning_starts_where_the_parent_ended(multi30k_dir, tmp_path, one_thread,
                                                   nmt_cli):
    """Parent on the first half of (a slice of) Multi30k; child on the other half, encoded
    with the parent's vocabulary (--spm-from) and started with --init-from: its valid loss
    at update 0 is the parent's last one, far below a model trained from scratch."""
    parent_data = write_text_data(tmp_path / "a", {
        "train": _pairs(multi30k_dir, "train", 0, 600),
        "valid": _pairs(multi30k_dir, "valid", 0, 40)}, vocab_size=600)
    child_data = tmp_path / "b"
    child_data.mkdir()
    for split, pairs in {"train": _pairs(multi30k_dir, "train", 14500, 15100),
                         "valid": _pairs(multi30k_dir, "valid", 0, 40)}.items():
        (child_data / f"{split}.src").write_text("".join(s + "\n" for s, _ in pairs))
        (child_data / f"{split}.tgt").write_text("".join(t + "\n" for _, t in pairs))
    cfg = _cfg(max_updates=80, valid_interval=40, save_interval_updates=40)
    flags = _cli_flags(cfg)
    parent = nmt_cli.run("train", str(parent_data), "-o", str(tmp_path / "parent"), *flags,
                         timeout=600)
    assert parent.returncode == 0, parent.err
    parent_valid = [r for r in read_jsonl(tmp_path / "parent" / "train_log.jsonl")
                    if r["kind"] == "valid"][-1]["valid_loss"]
    model = tmp_path / "parent" / "checkpoint_best.pt"

    mismatch = nmt_cli.run("train", str(parent_data), "-o", str(tmp_path / "wrong"),
                           *[f if f != "tiny" else "small" for f in flags], "--init-from",
                           str(model), timeout=600)
    assert mismatch.returncode == 6, mismatch.err
    lines = [x for x in mismatch.err.splitlines() if x.startswith("nmt train: error:")]
    assert len(lines) == 1 and "another architecture" in lines[0], mismatch.err
    assert "Traceback" not in mismatch.err

    run_bpe(child_data, BpeConfig(vocab_size=600, sample=0, threads=1))  # its own vocab
    other = nmt_cli.run("train", str(child_data), "-o", str(tmp_path / "wrongvocab"), *flags,
                        "--init-from", str(model), timeout=600)
    assert other.returncode == 6 and "--spm-from" in other.err, other.err

    bpe = nmt_cli.run("bpe", str(child_data), "--spm-from", str(model), timeout=600)
    assert bpe.returncode == 0, bpe.err
    child = nmt_cli.run("train", str(child_data), "-o", str(tmp_path / "child"), *flags,
                        "--init-from", str(model), timeout=600)
    assert child.returncode == 0, child.err
    assert "initialised from" in child.err
    records = [r for r in read_jsonl(tmp_path / "child" / "train_log.jsonl")
               if r["kind"] == "valid"]
    assert records[0]["step"] == 0
    assert records[0]["valid_loss"] == pytest.approx(parent_valid, rel=1e-5)
    scratch = nmt_cli.run("train", str(child_data), "-o", str(tmp_path / "scratch"), *flags,
                          "--max-updates", "1", "--valid-interval", "1", timeout=600)
    assert scratch.returncode == 0, scratch.err
    fresh = [r for r in read_jsonl(tmp_path / "scratch" / "train_log.jsonl")
             if r["kind"] == "valid"][0]["valid_loss"]
    assert records[0]["valid_loss"] < fresh - 1.0, (records[0]["valid_loss"], fresh)
    assert records[-1]["step"] == 80


def test_weighted_corpora_are_sampled_in_proportion(m30k):
    """Weights 2 / 1 / 1 over corpora of 100 / 100 / 200 pairs: half of every epoch's pairs
    from the first (each pair twice), a quarter from each other; seeded per epoch."""
    data = ParallelData.open(m30k, "train")
    ranges = [CorpusRange("a", 0, 100, 2.0), CorpusRange("b", 100, 200, 1.0),
              CorpusRange("c", 200, 400, 1.0)]
    assert corpus_counts(ranges) == [200, 100, 100]
    batches = EpochBatches(data.src.lengths, data.tgt.lengths, ranges, 512, 64, seed=3)
    assert batches.weighted
    epochs = []
    for epoch in (1, 2):
        got = batches.get(epoch)
        pairs = np.concatenate(got.batches)
        share = np.array([(pairs < 100).sum(), ((pairs >= 100) & (pairs < 200)).sum(),
                          (pairs >= 200).sum()]) / (400 - got.skipped)
        assert np.abs(share - [0.5, 0.25, 0.25]).max() < 0.01, share
        copies = np.bincount(pairs[pairs < 100], minlength=100)  # each pair twice...
        assert set(np.unique(copies)) <= {0, 2} and (copies == 0).sum() * 2 <= got.skipped
        epochs.append(np.sort(pairs[pairs >= 200]))
    assert not np.array_equal(epochs[0], epochs[1])  # another sample each epoch
    again = EpochBatches(data.src.lengths, data.tgt.lengths, ranges, 512, 64, seed=3)
    assert all(np.array_equal(x, y) for x, y in zip(again.get(2).batches,
                                                   batches.get(2).batches, strict=True))
    plain = EpochBatches(data.src.lengths, data.tgt.lengths, [CorpusRange("t", 0, 400, None)],
                         512, 64, seed=3)
    every = np.sort(np.concatenate(plain.get(5).batches))  # each kept pair once
    assert not plain.weighted and len(np.unique(every)) == len(every) == 400 - plain.get(
        5).skipped


def test_training_reads_corpus_weights_from_the_manifest(m30k, tmp_path, one_thread):
    """`nmt prep` records corpus weights in DATA/manifest.json: the trainer's epochs follow
    them (3 : 1 here) and a run trains on them."""
    from nmt.train.loop import Trainer

    data = tmp_path / "data"
    shutil.copytree(m30k, data)
    (data / "manifest.json").write_text(json.dumps({"splits": {"train": {"lines": 400, "corpora": [
        {"name": "a", "start": 0, "lines": 100, "weight": 3.0},
        {"name": "b", "start": 100, "lines": 300, "weight": 1.0}]}}}))
    trainer = Trainer(data, tmp_path / "run", MODEL, _cfg(max_updates=3), "cpu",
                      progress=False)
    assert trainer.epoch_batches.weighted
    pairs = np.concatenate(trainer.epoch_batches.get(1).batches)
    assert abs((pairs < 100).mean() - 0.75) < 0.01
    assert trainer.run().step == 3


@pytest.mark.slow  # trains 600 updates (12 s) so that beam and greedy output differ
def test_valid_bleu_decodes_as_translate_does(tmp_path, one_thread, monkeypatch):
    """--valid-bleu scores beam-search output (beam 4, alpha 0.6, as `nmt translate`),
    not greedy output: its BLEU and chrF equal those of translating valid.src with the
    model; --valid-beam 1 decodes greedily."""
    import sacrebleu
    from helpers.data import make_copy_data

    import nmt.inference.decoding as decoding
    from nmt.checkpoint import load_model
    from nmt.config import DecodeConfig
    from nmt.data.dataset import load_vocab
    from nmt.inference.translate import Engine
    from nmt.train.distributed import DistEnv
    from nmt.train.validate import validate

    data = make_copy_data(tmp_path / "copy", n_train=400, n_valid=40)
    train(data, tmp_path / "run", MODEL, _cfg(max_updates=600, warmup=100, lr_scale=1.0,
                                              save_interval_updates=0), "cpu",
          progress=False)
    path = tmp_path / "run" / "checkpoint_last.pt"
    model = load_model(path, weights="raw")[0]
    valid, vocab = ParallelData.open(data, "valid"), load_vocab(data)
    beams = []
    real = decoding.beam_search
    monkeypatch.setattr(decoding, "beam_search",
                        lambda *a, **k: beams.append(k["beam"]) or real(*a, **k))
    beam = validate(model, valid, vocab, _cfg(valid_bleu=True), torch.device("cpu"),
                    DistEnv(), bleu=True, data_dir=data)
    assert beams and set(beams) == {DecodeConfig().beam}
    beams.clear()
    validate(model, valid, vocab, _cfg(valid_bleu=True, valid_beam=1), torch.device("cpu"),
             DistEnv(), bleu=True, data_dir=data)
    assert beams == []  # greedy
    translator = Engine.load([path], DecodeConfig(), device="cpu", precision="fp32",
                                 weights="raw")
    sources = vocab.encode((data / "valid.src").read_text().splitlines())
    hyps = vocab.decode([h[0].tokens for h in translator.translate_ids(sources)])
    refs = (data / "valid.tgt").read_text().splitlines()
    assert 5 < beam["bleu"] == pytest.approx(sacrebleu.corpus_bleu(hyps, [refs]).score,
                                             abs=0.05)
    assert beam["chrf"] == pytest.approx(sacrebleu.corpus_chrf(hyps, [refs]).score, abs=0.05)
