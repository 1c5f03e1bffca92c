"""Training-state files: checkpoint_last as a hard link, pruning by the stored step read
memory-mapped, RNG restore from tensors on another device, and the torch-version guards."""

from __future__ import annotations

import errno
import os
import random
from pathlib import Path

import numpy as np
import pytest
import torch

import nmt.checkpoint as checkpoint_module
from nmt.checkpoint import FORMAT, load_checkpoint
from nmt.train import state
from nmt.train.schedule import total_norm
from nmt.train.state import LAST, capture_rng, prune_checkpoints, restore_rng, write_checkpoint


def _payload(step: int, size: int = 1000) -> dict:
    return {"format": FORMAT, "step": step, "model_config": {}, "vocab": b"spm",
            "model": {"w": torch.full((size,), float(step))}}


def test_last_is_a_hard_link_to_the_newest_numbered_checkpoint(tmp_path):
    for step in (1, 2, 3):
        path = write_checkpoint(_payload(step), tmp_path, keep_last=2)
        last = tmp_path / LAST
        assert os.stat(last).st_ino == os.stat(path).st_ino  # one file, two names
        assert load_checkpoint(last)["step"] == step
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "checkpoint_2.pt", "checkpoint_3.pt", LAST]
    assert load_checkpoint(tmp_path / "checkpoint_2.pt")["step"] == 2  # untouched by saves


def test_last_is_an_atomic_copy_where_hard_links_are_refused(tmp_path, monkeypatch):
    def no_links(src, dst):
        raise OSError(errno.EPERM, os.strerror(errno.EPERM))

    monkeypatch.setattr(state.os, "link", no_links)
    path = write_checkpoint(_payload(7), tmp_path, keep_last=2)
    last = tmp_path / LAST
    assert os.stat(last).st_ino != os.stat(path).st_ino
    assert last.read_bytes() == path.read_bytes()
    assert [p.name for p in tmp_path.iterdir() if p.name.endswith(".tmp")] == []


def test_prune_reads_steps_memory_mapped_and_by_content(tmp_path, monkeypatch):
    """Pruning maps each file instead of reading its tensors (tens of GB for big), and
    ranks files by the step stored inside, whatever their names say."""
    for name, step in (("checkpoint_9.pt", 1), ("checkpoint_1.pt", 5), ("checkpoint_5.pt", 9)):
        checkpoint_module.save_checkpoint(_payload(step), tmp_path / name)
    (tmp_path / "checkpoint_junk.pt").write_bytes(b"not a checkpoint")  # left alone
    calls = []
    real = torch.load

    def spy(*args, **kwargs):
        calls.append(kwargs.get("mmap"))
        return real(*args, **kwargs)

    monkeypatch.setattr(checkpoint_module.torch, "load", spy)
    removed = prune_checkpoints(tmp_path, keep_last=2)
    assert [p.name for p in removed] == ["checkpoint_9.pt"]  # stored step 1: the oldest
    assert calls and all(calls), calls
    assert (tmp_path / "checkpoint_junk.pt").exists()


class _OnOtherDevice:
    """A tensor as map_location=<a GPU> returns it: no `.numpy()` until `.cpu()`."""

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor

    def cpu(self) -> torch.Tensor:
        return self.tensor

    def numpy(self):
        raise TypeError("can't convert cuda:0 device type tensor to numpy. Use "
                        "Tensor.cpu() to copy the tensor to host memory first.")


def test_restore_rng_from_tensors_on_another_device():
    """A checkpoint loaded onto a GPU (its tensors there) still restores every RNG."""
    torch.manual_seed(3)
    random.seed(3)
    np.random.seed(3)
    saved = capture_rng()
    want = (torch.rand(3), random.random(), np.random.rand())
    moved = dict(saved, torch=_OnOtherDevice(saved["torch"]))
    moved["numpy"] = [saved["numpy"][0], _OnOtherDevice(saved["numpy"][1]),
                      *saved["numpy"][2:]]
    torch.manual_seed(99)
    random.seed(99)
    np.random.seed(99)
    restore_rng(moved)
    got = (torch.rand(3), random.random(), np.random.rand())
    assert torch.equal(got[0], want[0]) and got[1:] == want[1:]


def test_total_norm_without_get_total_norm(monkeypatch):
    """torch < 2.6 has no get_total_norm: the fallback gives the same norm."""
    grads = [torch.randn(4, 5), torch.randn(7), torch.randn(2, 2, 2)]
    want = total_norm(grads)
    monkeypatch.delattr(torch.nn.utils, "get_total_norm", raising=False)  # < 2.6: none
    got = total_norm(grads)
    torch.testing.assert_close(got, want)
    flat = torch.cat([g.reshape(-1) for g in grads])
    torch.testing.assert_close(got, flat.norm())


def test_stale_temp_of_a_killed_link_is_removed(tmp_path: Path):
    write_checkpoint(_payload(1), tmp_path, keep_last=2)
    stale = tmp_path / ".checkpoint_last.pt.abc123.tmp"
    os.link(tmp_path / "checkpoint_1.pt", stale)  # a save killed between link and rename
    write_checkpoint(_payload(2), tmp_path, keep_last=2)
    assert not stale.exists()


def test_model_payload_is_the_one_constructor_of_checkpoints():
    """Training checkpoints, the best model, averages and the benches' models are all
    put together by model_payload: the required keys, meta, then the extras; an extra that
    would replace a required key is a bug, refused."""
    from nmt.checkpoint import FORMAT, REQUIRED_KEYS, model_payload

    payload = model_payload(step=7, model_config={"d_model": 8}, vocab=b"spm",
                            model={"w": torch.zeros(1)}, optimizer={"state": {}})
    assert payload["format"] == FORMAT and payload["step"] == 7 and payload["meta"] == {}
    assert set(REQUIRED_KEYS) <= payload.keys() and payload["optimizer"] == {"state": {}}
    with pytest.raises(ValueError, match="would replace required ones"):
        model_payload(step=1, model_config={}, vocab=b"", model={}, format="other")
