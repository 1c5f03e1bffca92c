"""`nmt train` end to end on real Multi30k-derived data (through `nmt bpe`'s code path)."""

from __future__ import annotations

import shutil

import pytest
from helpers.data import multi30k_data

from nmt.checkpoint import load_checkpoint
from nmt.host_memory import heap_in_huge_pages, huge_page_heap_env
from nmt.train.log import read_jsonl


@pytest.fixture(scope="module")
def m30k_data(tmp_path_factory, request):
    return multi30k_data(tmp_path_factory.mktemp("m30k") / "data", n_train=2000, n_valid=100,
                         vocab_size=1000)


@pytest.mark.slow  # two interpreters and 8 updates: 10 s; the in-process test below is fast
def test_cli_trains_resumes_and_logs(m30k_data, tmp_path, nmt_cli):
    run = tmp_path / "run"
    common = [str(m30k_data), "-o", str(run), "--arch", "tiny", "--device", "cpu",
              "--max-tokens", "1024", "--warmup", "10", "--log-interval", "2",
              "--valid-interval", "4", "--valid-bleu", "--save-interval-updates", "3",
              "--keep-last", "2"]
    done = nmt_cli.run("train", *common, "--max-updates", "6")
    assert done.returncode == 0, done.err
    assert done.out == ""  # data only on stdout; progress and messages on stderr
    assert "update 6" in done.err and "checkpoint_6.pt" in done.err
    env = nmt_cli.env()  # the trainer re-executed itself with the heap in huge pages
    huge = heap_in_huge_pages(env) or huge_page_heap_env(env) is not None
    assert ("heap in transparent huge pages" in done.err) is huge
    assert sorted(p.name for p in run.glob("checkpoint_*.pt")) == [
        "checkpoint_3.pt", "checkpoint_6.pt", "checkpoint_best.pt", "checkpoint_last.pt"]
    assert load_checkpoint(run / "checkpoint_best.pt")["step"] == 4  # the one validation
    records = read_jsonl(run / "train_log.jsonl")
    train = [r for r in records if r["kind"] == "train"]
    assert [r["step"] for r in train] == [2, 4, 6]
    assert train[-1]["loss"] < train[0]["loss"]
    valid = [r for r in records if r["kind"] == "valid"]
    assert valid and {"valid_loss", "valid_ppl", "valid_bleu"} <= set(valid[0])
    again = nmt_cli.run("train", *common, "--max-updates", "8")
    assert again.returncode == 0, again.err
    assert "resuming from update 6" in again.err
    assert load_checkpoint(run / "checkpoint_last.pt")["step"] == 8


def test_cli_rejects_bad_flags(m30k_data, tmp_path, nmt_cli):
    """In process (no interpreter start): each usage error is one line with its exit code."""

    def train(*args: str) -> tuple[int, str]:
        result = nmt_cli.invoke("train", *args)
        return result.returncode, result.stderr.decode()

    code, err = train(str(m30k_data), "-o", str(tmp_path / "r"), "--precision", "fp8")
    assert code == 2 and "unknown precision" in err and len(err.strip().splitlines()) == 1
    code, err = train(str(m30k_data), "-o", str(tmp_path / "r"), "--arch", "huge")
    assert code == 2 and "unknown arch" in err
    code, err = train(str(tmp_path / "nothing"), "-o", str(tmp_path / "r"))
    assert code == 3 and "nmt bpe" in err
    assert not (tmp_path / "r").exists()


def test_a_broken_valid_split_is_an_error_not_skipped(m30k_data, tmp_path, nmt_cli):
    """A valid split that was binarized but cannot be read stops training with the file
    named (exit 3); only a split never binarized means "no validation"."""
    data = tmp_path / "data"
    shutil.copytree(m30k_data, data)
    (data / "bin" / "valid.tgt.tokens.npy").write_bytes(b"not an array")
    result = nmt_cli.invoke("train", str(data), "-o", str(tmp_path / "r"), "--arch", "tiny",
                            "--device", "cpu", "--max-updates", "1")
    err = result.stderr.decode()
    assert result.returncode == 3 and "valid.tgt.tokens.npy" in err, err
    errors = [line for line in err.splitlines() if line.startswith("nmt train: error:")]
    assert len(errors) == 1 and "valid.tgt" in errors[0] and "Traceback" not in err


@pytest.mark.slow
def test_cli_nproc_2_runs_under_torchrun(m30k_data, tmp_path, nmt_cli):
    run = tmp_path / "run"
    done = nmt_cli.run("train", str(m30k_data), "-o", str(run), "--arch", "tiny", "--device",
                       "cpu", "--nproc", "2", "--max-tokens", "1024", "--max-updates", "3",
                       "--log-interval", "1")
    assert done.returncode == 0, done.err
    records = read_jsonl(run / "train_log.jsonl")
    assert [r["world_size"] for r in records if r["kind"] == "train"] == [2, 2, 2]
    assert len(load_checkpoint(run / "checkpoint_last.pt")["rng"]) == 2
