"""Checkpoint averaging: the pure function, "last N by stored step", and the CLI."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from helpers.checkpoints import make_checkpoint, make_vocab
from helpers.cli import NmtCli

from nmt.average import average_state_dicts, last_checkpoints
from nmt.checkpoint import load_checkpoint, save_checkpoint
from nmt.errors import CheckpointError

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def spm(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from conftest import shared_data_path

    return make_vocab(shared_data_path("multi30k"), tmp_path_factory.mktemp("avg"))


def test_average_of_copies_is_the_copy() -> None:
    torch.manual_seed(0)
    state = {"w": torch.randn(5, 3), "h": torch.randn(4).half(), "n": torch.tensor([7])}
    out = average_state_dicts([state, state, state])
    for key in state:
        assert out[key].dtype == state[key].dtype
        assert torch.equal(out[key], state[key])


def test_average_of_two_is_their_mean() -> None:
    torch.manual_seed(1)
    a = {"w": torch.randn(6, 2), "b": torch.randn(2).bfloat16()}
    b = {"w": torch.randn(6, 2), "b": torch.randn(2).bfloat16()}
    out = average_state_dicts([a, b])
    assert torch.equal(out["w"], ((a["w"].double() + b["w"].double()) / 2).float())
    assert torch.allclose(out["w"], (a["w"] + b["w"]) / 2, atol=1e-7)
    expected = ((a["b"].double() + b["b"].double()) / 2).bfloat16()  # summed wide
    assert torch.equal(out["b"], expected)


def test_mismatches_name_file_and_key() -> None:
    a = {"w": torch.zeros(2, 2)}
    with pytest.raises(CheckpointError, match=r"b\.pt: w has shape \(3, 2\)"):
        average_state_dicts([a, {"w": torch.zeros(3, 2)}], ["a.pt", "b.pt"])
    with pytest.raises(CheckpointError, match=r"b\.pt: parameter names differ.*first: v"):
        average_state_dicts([a, {"v": torch.zeros(2, 2)}], ["a.pt", "b.pt"])
    with pytest.raises(CheckpointError, match="non-float tensor n differs"):
        average_state_dicts([{"n": torch.tensor([1])}, {"n": torch.tensor([2])}], ["a", "b"])


def test_last_n_uses_stored_step_not_file_name(spm: Path, tmp_path: Path) -> None:
    run = tmp_path / "run"
    run.mkdir()
    # File names deliberately disagree with the steps stored inside.
    make_checkpoint(spm, run / "checkpoint_900.pt", seed=1, step=100)
    make_checkpoint(spm, run / "checkpoint_100.pt", seed=2, step=300)
    make_checkpoint(spm, run / "checkpoint_200.pt", seed=3, step=200)
    make_checkpoint(spm, run / "checkpoint_last.pt", seed=2, step=300)  # duplicate step
    assert last_checkpoints(run, 2) == [run / "checkpoint_200.pt", run / "checkpoint_100.pt"]
    assert len(last_checkpoints(run, 3)) == 3
    with pytest.raises(Exception, match="only 3 distinct steps"):
        last_checkpoints(run, 4)


def test_cli_average_loads_in_translate(spm: Path, tmp_path: Path, nmt_cli: NmtCli) -> None:
    run = tmp_path / "run"
    run.mkdir()
    paths = [make_checkpoint(spm, run / f"checkpoint_{s}.pt", seed=s, step=s) for s in (1, 2, 3)]
    payload = load_checkpoint(paths[0])
    payload["optimizer"] = {"state": {}, "param_groups": []}  # training state is dropped
    save_checkpoint(payload, paths[0])
    out = tmp_path / "avg" / "averaged.pt"
    result = nmt_cli.invoke("average", str(run), "--last", "3", "-o", str(out))
    assert result.returncode == 0, result.stderr.decode()
    avg = load_checkpoint(out)
    assert avg["step"] == 3 and "optimizer" not in avg
    assert [item["step"] for item in avg["meta"]["averaged_from"]] == [1, 2, 3]
    states = [load_checkpoint(p)["model"] for p in paths]
    for key, value in avg["model"].items():
        mean = sum(s[key].float() for s in states) / 3
        assert torch.allclose(value, mean, atol=1e-6), key
    # Explicit files give the same result, and the output translates.
    out2 = tmp_path / "avg2.pt"
    result = nmt_cli.invoke("average", *map(str, paths), "-o", str(out2))
    assert result.returncode == 0, result.stderr.decode()
    assert all(torch.equal(v, load_checkpoint(out2)["model"][k])
               for k, v in avg["model"].items())
    result = nmt_cli.invoke("translate", "-m", str(out), "--max-len-b", "3", input=b"a dog\n\n")
    assert result.returncode == 0, result.stderr.decode()
    assert result.stdout.count(b"\n") == 2


def test_cli_average_refuses_mismatched_models(spm: Path, tmp_path: Path, nmt_cli: NmtCli) -> None:
    a = make_checkpoint(spm, tmp_path / "a.pt", step=1)
    b = make_checkpoint(spm, tmp_path / "b.pt", step=2, d_ff=256)
    result = nmt_cli.invoke("average", str(a), str(b), "-o", str(tmp_path / "out.pt"))
    assert result.returncode == 6
    assert b"b.pt: model_config differs" in result.stderr and b"d_ff" in result.stderr
    assert not (tmp_path / "out.pt").exists()
    result = nmt_cli.invoke("average", str(tmp_path), "-o", str(tmp_path / "out.pt"))
    assert result.returncode == 2 and b"--last" in result.stderr


@pytest.mark.slow  # writes ten 360 MB checkpoints
def test_average_of_ten_training_checkpoints_stays_near_one_model(tmp_path: Path,
                                                                  nmt_cli: NmtCli) -> None:
    """`nmt average --last 10` of checkpoints shaped like big's layers (d_model 1024, d_ff
    4096, 16 heads; one layer each side, 30M parameters), each with Adam's two moments
    beside the weights (3x the weights on disk): its peak RSS, over a process that has
    only imported the same modules, stays under 2x one model's weights. Reading every file
    whole would need 30x."""
    from nmt.checkpoint import model_payload
    from nmt.config import model_preset
    from nmt.model.transformer import Transformer

    cfg = model_preset("big", vocab_size=1000, encoder_layers=1, decoder_layers=1)
    torch.manual_seed(0)
    model = Transformer(cfg)
    weights = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    run = tmp_path / "run"
    run.mkdir()
    for step in range(1, 11):
        with torch.no_grad():
            for param in model.parameters():
                param.add_(0.01)
        state = {k: v.clone() for k, v in model.state_dict().items()}
        moments = {i: {"step": torch.tensor(float(step)), "exp_avg": torch.randn_like(p),
                       "exp_avg_sq": torch.rand_like(p)}
                   for i, p in enumerate(model.parameters())}
        save_checkpoint(model_payload(step=step, model_config=cfg.to_dict(), vocab=b"spm",
                                      model=state, optimizer={"state": moments,
                                                              "param_groups": []}),
                        run / f"checkpoint_{step}.pt")
        del state, moments
    # VmHWM: this process image's peak RSS (ru_maxrss would carry the parent's across exec)
    probe = ("import atexit, sys\n"
             "def hwm():\n"
             "    for line in open('/proc/self/status'):\n"
             "        if line.startswith('VmHWM:'):\n"
             "            print('MAXRSS_KB', line.split()[1], file=sys.stderr)\n"
             "atexit.register(hwm)\n"
             "import torch, nmt.average, nmt.checkpoint, nmt.cli.main\n")
    runner = nmt_cli.instrumented(probe + "from nmt.cli.main import main\nmain()\n")
    out = tmp_path / "average.pt"
    result = runner.run("average", run, "--last", "10", "-o", out)
    assert result.returncode == 0, result.err
    baseline = nmt_cli.instrumented(probe).run()

    def peak(text: str) -> int:
        return 1024 * int(next(line.split()[1] for line in text.splitlines()
                               if line.startswith("MAXRSS_KB")))

    grew = peak(result.err) - peak(baseline.err)
    assert grew < 2 * weights, f"peak RSS grew {grew / 2**20:.0f} MiB for a model of " \
                               f"{weights / 2**20:.0f} MiB"
    averaged = load_checkpoint(out)["model"]
    last = load_checkpoint(run / "checkpoint_10.pt", mmap=True)["model"]
    key = "encoder.0.ffn.fc1.weight"
    torch.testing.assert_close(averaged[key], last[key] - 0.045, rtol=0, atol=1e-5)
