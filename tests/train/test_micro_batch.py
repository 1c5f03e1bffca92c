"""The micro-batch planned from a GPU's memory (nmt/train/micro_batch.py): the arithmetic
of the cap, the worst-case check that shrinks it after an out-of-memory error, and
`--max-tokens 0` on a CPU (the default cap; host memory is not the limit)."""

from __future__ import annotations

import pytest
import torch
from helpers.data import make_copy_data

import nmt.train.loop as loop
from nmt.config import TrainConfig, model_preset
from nmt.errors import UsageError
from nmt.train import micro_batch
from nmt.train.micro_batch import plan_cap, plan_micro_tokens, update_tokens

GIB = 2 ** 30


def test_cap_fits_the_usable_memory_beside_the_static_part() -> None:
    # 80 GB, 4 GiB static, 1 MiB per token: (0.85 * 80e9 - 4 GiB) / 1 MiB, to 256s
    cap = plan_cap(80 * 10 ** 9, 4 * GIB, 2 ** 20, ceiling=10 ** 6, floor=256)
    assert cap % 256 == 0
    assert cap * 2 ** 20 <= 0.85 * 80e9 - 4 * GIB < (cap + 256) * 2 ** 20
    assert plan_cap(80 * 10 ** 9, 4 * GIB, 2 ** 20, ceiling=27904, floor=256) == 27904
    assert plan_cap(8 * GIB, 7 * GIB, 2 ** 20, ceiling=27904, floor=256) == 256


def test_update_tokens_hold_the_share_of_one_process() -> None:
    assert update_tokens(25000, 1) == 27904  # 25,000 / 0.9, to 256s
    assert update_tokens(25000, 8) == 3584


def test_plan_measures_then_checks_and_shrinks_after_oom() -> None:
    calls: list[int] = []
    limit = 20000  # tokens the "device" holds

    def peak_of(tokens: int) -> int:
        calls.append(tokens)
        if tokens > limit:
            raise MemoryError("out of memory")
        return tokens * 2 ** 20

    plan = plan_micro_tokens(peak_of, device_bytes=141 * 10 ** 9, static_bytes=2 * GIB,
                             ceiling=27904, floor=256,
                             is_oom=lambda e: isinstance(e, MemoryError))
    assert calls[0] == micro_batch.PROBE_TOKENS and calls[1] == 27904
    assert plan.micro_tokens <= limit and plan.micro_tokens % 256 == 0
    assert plan.bytes_per_token == 2 ** 20
    assert "MiB per token measured" in plan.describe()

    def broken(tokens: int) -> int:
        raise RuntimeError("not memory")

    with pytest.raises(RuntimeError):
        plan_micro_tokens(broken, device_bytes=GIB, static_bytes=0, ceiling=1024, floor=256,
                          is_oom=lambda e: isinstance(e, MemoryError))


def test_zero_max_tokens_on_a_cpu_takes_the_default(tmp_path) -> None:
    data = make_copy_data(tmp_path / "copy", n_train=40, n_valid=5)
    torch.set_num_threads(1)
    cfg = TrainConfig(max_tokens=0, batch_tokens=300, max_updates=1, warmup=1, max_len=16,
                      save_interval_minutes=0, valid_interval=1000, precision="fp32")
    trainer = loop.Trainer(data, tmp_path / "run", model_preset("tiny"), cfg, "cpu",
                           progress=False)
    assert trainer.train_cfg.max_tokens == micro_batch.DEFAULT_TOKENS
    assert trainer.batching.micro_tokens <= micro_batch.DEFAULT_TOKENS


def test_settings_are_checked() -> None:
    with pytest.raises(UsageError, match="add --compile"):
        TrainConfig(cuda_graphs=True)
    with pytest.raises(UsageError, match="half-weights"):
        TrainConfig(half_weights="sometimes")
    with pytest.raises(UsageError):
        TrainConfig(max_tokens=-1)
