"""Builders of small binarized DATA dirs for the training tests (through the real `nmt bpe`
code path), and a check that what they build is what training reads."""

from __future__ import annotations

import random
from pathlib import Path

from conftest import torch_threads

from nmt.config import ModelConfig, TrainConfig
from nmt.data.bpe import BpeConfig, run_bpe
from nmt.data.dataset import ParallelData, load_vocab

WORDS = ("red blue green cat dog bird tree house river stone moon sun car boat "
         "hat shoe cup lamp door road").split()


def write_text_data(data_dir: Path, splits: dict[str, list[tuple[str, str]]],
                    vocab_size: int) -> Path:
    """Write DATA/{split}.src/.tgt from pairs, then learn BPE and binarize (run_bpe)."""
    data_dir.mkdir(parents=True, exist_ok=True)
    for split, pairs in splits.items():
        (data_dir / f"{split}.src").write_text("".join(s + "\n" for s, _ in pairs))
        (data_dir / f"{split}.tgt").write_text("".join(t + "\n" for _, t in pairs))
    run_bpe(data_dir, BpeConfig(vocab_size=vocab_size, sample=0, threads=1))
    return data_dir


def copy_task_pairs(n: int, seed: int, min_len: int = 3, max_len: int = 10,
                    reverse: bool = False) -> list[tuple[str, str]]:
    """Random sentences over a 20-word vocabulary; target = source (or reversed)."""
    rng = random.Random(seed)
    pairs = []
    for _ in range(n):
        words = [rng.choice(WORDS) for _ in range(rng.randint(min_len, max_len))]
        target = list(reversed(words)) if reverse else words
        pairs.append((" ".join(words), " ".join(target)))
    return pairs


def make_copy_data(data_dir: Path, n_train: int = 400, n_valid: int = 40,
                   reverse: bool = False, max_len: int = 10) -> Path:
    """A tiny copy (or reversal) task DATA dir with train and valid splits; the vocabulary
    is big enough for every word to be one piece."""
    return write_text_data(data_dir, {
        "train": copy_task_pairs(n_train, seed=1, reverse=reverse, max_len=max_len),
        "valid": copy_task_pairs(n_valid, seed=2, reverse=reverse, max_len=max_len),
    }, vocab_size=360)


def train_one_thread(data_dir: Path, run_dir: Path, model_cfg: ModelConfig,
                     cfg: TrainConfig) -> Path:
    """Train a test model on the CPU with one thread (deterministic, and no oversubscribed
    cores); returns RUN/checkpoint_last.pt."""
    from nmt.train.loop import train

    with torch_threads(1):
        train(data_dir, run_dir, model_cfg, cfg, device="cpu", progress=False)
    return run_dir / "checkpoint_last.pt"


def test_fixture_data_reads_back(tmp_path):
    data_dir = make_copy_data(tmp_path / "data", n_train=50, n_valid=5)
    vocab = load_vocab(data_dir)
    train = ParallelData.open(data_dir, "train")
    assert len(train) == 50
    first_src = (data_dir / "train.src").read_text().splitlines()[0]
    assert vocab.decode([train.src[0].tolist()]) == [first_src]
    assert (train.src.lengths == train.tgt.lengths).all()  # copy task
