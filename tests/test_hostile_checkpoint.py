"""Issue 6, hostile files: a checkpoint that runs code when unpickled is refused by
`translate` and `average` (exit 6, one line), and the code provably never runs."""

from __future__ import annotations

import pickle
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers.checkpoints import RunsCode, make_checkpoint, make_vocab
from helpers.cli import NmtCli

from nmt.checkpoint import FORMAT

pytestmark = pytest.mark.usefixtures("one_thread")


def hostile_files(tmp_path: Path, marker: Path) -> list[Path]:
    """The same payload as a torch zip checkpoint and as a bare (legacy) pickle."""
    evil = RunsCode(f"touch {marker}")
    zipped = tmp_path / "evil_zip.pt"
    torch.save({"format": FORMAT, "step": 1, "model_config": {}, "vocab": b"",
                "model": evil}, zipped)
    bare = tmp_path / "evil_pickle.pt"
    bare.write_bytes(pickle.dumps({"format": FORMAT, "model": evil}))
    return [zipped, bare]


def test_control_the_files_do_run_code_when_loaded_unsafely(tmp_path: Path) -> None:
    """Without this, a refusal could be a broken file rather than a blocked attack."""
    marker = tmp_path / "control_marker"
    for path in hostile_files(tmp_path, marker):
        code = ("import torch, sys; torch.load(sys.argv[1], weights_only=False)")
        subprocess.run([sys.executable, "-c", code, str(path)], check=False,
                       capture_output=True, timeout=120)
        assert marker.exists(), path
        marker.unlink()


@pytest.mark.parametrize("runner", ["in_process",
                                    pytest.param("subprocess", marks=pytest.mark.slow)])
def test_translate_and_average_refuse_and_nothing_runs(tmp_path: Path, runner: str,
                                                       nmt_cli: NmtCli) -> None:
    marker = tmp_path / "pwned_marker"
    run = nmt_cli.invoke if runner == "in_process" else nmt_cli.run
    for path in hostile_files(tmp_path, marker):
        result = run("translate", "-m", str(path), input=b"hello\n")
        assert result.returncode == 6, result.stderr
        lines = result.stderr.decode().strip().splitlines()
        assert len(lines) == 1 and "refused to load" in lines[0] and str(path) in lines[0]
        assert result.stdout == b""
        out = tmp_path / "avg.pt"
        result = run("average", str(path), str(path), "-o", str(out))
        assert result.returncode == 6 and b"refused to load" in result.stderr
        assert not out.exists()
        assert not marker.exists()


def test_average_refuses_a_run_dir_holding_one_hostile_file(tmp_path: Path,
                                                            nmt_cli: NmtCli) -> None:
    from conftest import shared_data_path

    marker = tmp_path / "pwned_marker"
    spm = make_vocab(shared_data_path("multi30k"), tmp_path / "spm")
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    make_checkpoint(spm, run_dir / "checkpoint_10.pt", step=10)
    evil = hostile_files(tmp_path, marker)[0]
    (run_dir / "checkpoint_20.pt").write_bytes(evil.read_bytes())
    result = nmt_cli.invoke("average", str(run_dir), "--last", "1", "-o", str(tmp_path / "o.pt"))
    assert result.returncode == 6 and b"checkpoint_20.pt: refused to load" in result.stderr
    assert not marker.exists() and not (tmp_path / "o.pt").exists()


def test_truncated_or_corrupt_checkpoint_says_so_in_one_whole_sentence(tmp_path: Path,
                                                                        nmt_cli: NmtCli) -> None:
    """A cut copy (torch's zip reader error would end mid-sentence when shortened), an
    empty file and a cut inside the last record all read as truncated or corrupt."""
    from conftest import shared_data_path

    spm = make_vocab(shared_data_path("multi30k"), tmp_path / "spm")
    whole = make_checkpoint(spm, tmp_path / "whole.pt").read_bytes()
    for name, data in (("half.pt", whole[: len(whole) // 2]), ("empty.pt", b""),
                       ("head.pt", whole[:100]), ("tail_cut.pt", whole[:-30])):
        path = tmp_path / name
        path.write_bytes(data)
        result = nmt_cli.invoke("translate", "-m", str(path), input=b"hello\n")
        lines = result.stderr.decode().strip().splitlines()
        assert result.returncode == 6 and len(lines) == 1, (name, result.stderr)
        assert f"{path}: truncated or corrupt checkpoint" in lines[0], lines[0]
        assert lines[0].endswith("use another checkpoint of the run"), lines[0]
    garbage = tmp_path / "notes.pt"
    garbage.write_bytes(b"hello world, not a checkpoint")
    result = nmt_cli.invoke("translate", "-m", str(garbage), input=b"hello\n")
    assert result.returncode == 6
    assert f"{garbage}: not a readable nmt checkpoint" in result.stderr.decode()


def test_ema_best_checkpoint_serves_weights_ema_and_refuses_raw(tmp_path: Path,
                                                                nmt_cli: NmtCli) -> None:
    """checkpoint_best.pt of an --ema-decay run holds the validated EMA weights under
    "model" (its meta says so): `--weights ema` takes them; `raw` says what the file holds."""
    from conftest import shared_data_path

    from nmt.checkpoint import load_checkpoint, model_state, save_checkpoint

    spm = make_vocab(shared_data_path("multi30k"), tmp_path / "spm")
    path = make_checkpoint(spm, tmp_path / "checkpoint_best.pt")
    payload = load_checkpoint(path)
    payload["meta"]["best"] = {"metric": "loss", "score": 3.0, "ema": True}
    save_checkpoint(payload, path)
    for weights in ("ema", "auto"):
        assert model_state(payload, weights, path) is payload["model"]
        result = nmt_cli.invoke("translate", "-m", str(path), "--weights", weights,
                                input=b"a dog\n")
        assert result.returncode == 0 and result.stdout.count(b"\n") == 1, result.stderr
    result = nmt_cli.invoke("translate", "-m", str(path), "--weights", "raw", input=b"a dog\n")
    assert result.returncode == 6 and result.stdout == b""
    message = result.stderr.decode().strip()
    assert "holds only the EMA weights" in message and len(message.splitlines()) == 1
    plain = make_checkpoint(spm, tmp_path / "plain.pt")  # no EMA at all: as before
    result = nmt_cli.invoke("translate", "-m", str(plain), "--weights", "ema", input=b"a dog\n")
    assert result.returncode == 6 and b"holds no EMA weights" in result.stderr
