"""Builders of small binarized DATA dirs for the training tests (through the real `nmt bpe`
code path; tests/train/test_train_fixtures.py checks that what they build is what training reads),
and the small CPU training run of the fault tests, as CLI flags and as configs."""

from __future__ import annotations

import random
from pathlib import Path

from conftest import shared_data_path, torch_threads

from nmt.config import ModelConfig, TrainConfig, model_preset
from nmt.data.bpe import BpeConfig, run_bpe

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


def multi30k_data(data_dir: Path, n_train: int, n_valid: int, vocab_size: int) -> Path:
    """The first `n_train` real Multi30k training pairs and `n_valid` validation pairs
    (../shared/data/multi30k), with joint BPE of `vocab_size` (write_text_data)."""
    multi30k = shared_data_path("multi30k")

    def lines(name: str, n: int) -> list[str]:
        return (multi30k / name).read_text(encoding="utf-8").splitlines()[:n]

    return write_text_data(data_dir, {
        "train": list(zip(lines("train.en", n_train), lines("train.de", n_train), strict=True)),
        "valid": list(zip(lines("val.en", n_valid), lines("val.de", n_valid), strict=True)),
    }, vocab_size=vocab_size)


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


# The fault tests' run: tiny, on the CPU, dropout on (its RNG state must survive every kill
# too), a checkpoint at every update. The same settings as flags and as configs.
MODEL_FLAGS = ["--arch", "tiny", "--dropout", "0.1", "--device", "cpu"]
MODEL = model_preset("tiny", dropout=0.1)
FAST = dict(max_tokens=512, warmup=10, seed=7, log_interval=1, valid_interval=1000,
            save_interval_minutes=0, save_interval_updates=1, keep_last=3)
FAST_FLAGS = ["--max-tokens", "512", "--warmup", "10", "--seed", "7", "--log-interval", "1",
              "--valid-interval", "1000", "--save-interval-minutes", "0",
              "--save-interval-updates", "1", "--keep-last", "3"]
