"""bench/gpu_train_speed.py and bench/gpu_translate_speed.py in their CPU smoke modes, so
the scripts a GPU session runs cannot rot between GPU sessions. Checks the
JSON line's fields, not speed."""

from __future__ import annotations

import itertools
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}


def _run(args: list[str], env: dict[str, str] | None = None) -> dict:
    result = subprocess.run([sys.executable, *args], capture_output=True, text=True,
                            timeout=600, env=env or ENV, cwd=REPO)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("loss", ["reference", "fused"])
def test_train_speed_smoke(loss):
    report = _run(["bench/gpu_train_speed.py", "--smoke", "--loss", loss])
    assert report["bench"] == "gpu_train_speed" and report["smoke"] and report["loss"] == loss
    assert report["arch"] == "tiny" and report["device"] == "cpu" and report["updates"] == 2
    # One GPU's shape of the smoke recipe (max-tokens 1024, batch-tokens 2048 real tokens
    # per side), derived from the fill measured on the bench's WMT-like lengths: 3 x 739.
    assert report["gpus"] == 1 and report["update_freq"] == 3
    assert report["micro_tokens"] == 739 and report["batch_tokens"] == 2048
    assert 3 * 739 * report["fill"] == pytest.approx(2048, rel=0.01)
    assert "by_loss" not in report  # one loss: no comparison
    assert report["finite"] and report["tokens_per_s"] > 0 and report["step_time_s"] > 0
    assert report["src_tokens"] > 0 and report["tgt_tokens"] > 0
    assert report["mfu"] is None  # no peak for a CPU
    params = report["params"]
    assert params["encoder"] + params["decoder"] + params["output_projection"] == \
        params["total"]
    assert report["model_tflops"] > 0 and report["attention_tflops"] > 0


@pytest.mark.slow  # the fast loop keeps its module's cheaper tests
def test_train_speed_mfu_with_a_given_peak():
    report = _run(["bench/gpu_train_speed.py", "--smoke", "--peak-tflops", "1"])
    assert report["mfu"] == pytest.approx(report["model_tflops"] / 1.0)
    assert report["mfu_with_attention"] > report["mfu"]
    assert report["mfu_6n_all_tokens"] > report["mfu"]


def test_translate_speed_smoke(wmt14_dir, tmp_path):
    env = {**ENV, "NMT_SHARED_DATA": str(wmt14_dir.parent)}
    report = _run(["bench/gpu_translate_speed.py", "--smoke", "--cache", str(tmp_path)], env)
    assert report["bench"] == "gpu_translate_speed" and report["smoke"]
    assert report["lines"] == 20 and report["beam"] == 4 and report["alpha"] == 0.6
    nmt = report["nmt"]["fp32"]
    assert nmt["sentences"] == 20 and nmt["sentences_per_s"] > 0 and nmt["tgt_tokens"] > 0
    if report["ct2"]:  # ctranslate2 importable (the dev extra) or bench/.venv-ct2 present
        ct2 = report["ct2"]["float32"]
        assert ct2["sentences"] == 20 and ct2["logp_max_abs_diff"] < 1e-3
        assert report["ratios"]["ct2_float32_over_nmt_fp32"] > 0
    else:
        assert report["ct2_skipped"]


@pytest.mark.slow  # the fast loop keeps its module's cheaper tests
def test_train_speed_smoke_8_gpu_shape_both_losses():
    """--gpus 8 --loss both: one GPU's share of an 8-GPU run (1 micro-batch of 1/8 of the
    batch), the reference and the fused loss timed in one process from the same weights,
    compared, and auto's choice on this device set against the faster."""
    report = _run(["bench/gpu_train_speed.py", "--smoke", "--gpus", "8", "--loss", "both"])
    assert report["gpus"] == 8 and report["update_freq"] == 1
    # 2048 / 8 = 256 real tokens per side per GPU: 292 slots at the measured fill (the
    # smoke's 3,308; 256 when the figure counted padded slots).
    assert report["micro_tokens"] == 292
    assert 8 * 292 * report["fill"] == pytest.approx(2048, rel=0.01)
    assert report["losses"] == ["reference", "fused"] and report["loss"] == "reference"
    by_loss = report["by_loss"]
    assert set(by_loss) == {"reference", "fused"}
    for name, figures in by_loss.items():
        assert figures["finite"] and figures["step_time_s"] > 0, name
        assert figures["tokens_per_s_all_gpus_no_comm"] == pytest.approx(
            8 * figures["tokens_per_s"])
        assert figures["peak_host_rss_gib"] > 0  # a CPU: no GPU figure pretended
        assert "peak_memory_allocated_gib" not in figures
    assert by_loss["reference"]["chunk_rows"] is None and by_loss["fused"]["chunk_rows"] > 0
    # The top-level figures are the first loss's, so single-loss readers still work.
    assert report["step_time_s"] == by_loss["reference"]["step_time_s"]
    # Same weights, batch and dropout masks: the two losses agree on the first update.
    assert report["first_update_loss_max_abs_diff"] < 1e-3
    assert by_loss["fused"]["loss_per_token_first_update"] == pytest.approx(
        by_loss["reference"]["loss_per_token_first_update"], abs=1e-3)
    faster = min(by_loss, key=lambda name: by_loss[name]["step_time_s"])
    assert report["fastest_loss"] == faster
    assert report["step_time_vs_first"]["reference"] == 1.0
    assert report["step_time_vs_first"]["fused"] == pytest.approx(
        by_loss["fused"]["step_time_s"] / by_loss["reference"]["step_time_s"])
    assert report["auto_fused_loss"] == "reference"  # --fused-loss auto on a CPU
    assert report["auto_is_fastest"] == (faster == "reference")
    assert report["lowest_memory_loss"] is None  # a CPU's peak RSS is not per loss


def test_train_speed_shapes_and_loss_lists_without_running(monkeypatch):
    """The fast loop's share: the WMT recipe's shapes (25,000 real tokens per side per
    update, derived as `nmt train` does from the fill measured on WMT-like lengths: 1 GPU
    3 x 8,805; 8 GPUs 1 x 3,308 each), --loss lists, bad flag combinations."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("gpu_train_speed",
                                                  REPO / "bench" / "gpu_train_speed.py")
    assert spec is not None and spec.loader is not None
    bench = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "gpu_train_speed", bench)  # its dataclass looks it up
    spec.loader.exec_module(bench)
    for gpus, shape in ((1, (3, 8805)), (8, (1, 3308)), (2, (2, 6608))):
        freq, micro, fill = bench.update_shape(bench.parse_args(["--gpus", str(gpus)]))
        assert (freq, micro) == shape
        assert gpus * freq * micro * fill == pytest.approx(25000, rel=0.002)
    assert bench.update_shape(bench.parse_args(["--update-freq", "3"])) == (3, 12500, None)
    assert bench.parse_args(["--loss", "both"]).losses == ["reference", "fused"]
    assert bench.loss_list("fused, reference,fused") == ["fused", "reference"]
    assert bench.loss_list("all") == ["reference", "fused", "fused-compiled"]
    with pytest.raises(ValueError, match="unknown 'fast'"):
        bench.loss_list("reference,fast")
    for bad in (["--loss", "fast"], ["--gpus", "0"], ["--gpus", "8", "--update-freq", "2"]):
        with pytest.raises(SystemExit):
            bench.parse_args(bad)


@pytest.mark.slow
def test_count_ops_smoke_counts_each_lever_and_feeds_the_gpu_model(tmp_path):
    """--count-ops on the tiny model (the GPU's code path, on the CPU): a bf16 copy leaves
    no autocast weight cast, each lever dispatches no more per update than the one before
    it; bench/gpu_model.py reads its JSON. (Its compiled levers are left out: a compile
    costs CI half a minute, and tests/train/test_buckets.py counts the graphs and breaks.)"""
    counts = tmp_path / "counts.json"
    report = _run(["bench/gpu_train_speed.py", "--smoke", "--count-ops", "--no-compile-count",
                   "--json-out", str(counts)])
    assert report["bench"] == "gpu_train_speed_count_ops"
    by = {(r["shape"], r["lever"]): r for r in report["records"]}
    eager, half = by[("1gpu", "eager")], by[("1gpu", "bf16-weights")]
    assert eager["weight_casts_per_micro"] > 0 and half["weight_casts_per_micro"] == 0
    levers = ["eager", "bf16-weights", "padded-vocab", "rows-linear", "one-micro"]
    hosts = [by[("1gpu", lever)]["host_ops_per_update"] for lever in levers]
    assert all(b <= a * 1.01 for a, b in itertools.pairwise(hosts)), hosts
    assert ("1gpu", "compile") not in by
    assert report["micro_batch_plans"] and json.loads(counts.read_text())["records"]
    # The model needs base's eager records to calibrate on: tiny's are refused ...
    result = subprocess.run([sys.executable, "bench/gpu_model.py", str(counts)], cwd=REPO,
                            capture_output=True, text=True, timeout=120, env=ENV)
    assert result.returncode == 2 and "base" in result.stderr
    # ... and taken with a host cost given.
    model = _run(["bench/gpu_model.py", str(counts), "--host-cost-us", "10"])
    assert model["bench"] == "gpu_model" and model["predictions"]


@pytest.mark.parametrize("flags", [["--half-weights"],
                                   ["--half-weights", "--compile", "--cuda-graphs",
                                    "--max-buckets", "1"]])
def test_train_speed_smoke_levers(flags):
    """The levers as the GPU session times them: a bf16 copy (and compiled, static shapes);
    the first update's loss equals autocast's within bf16 noise."""
    base = _run(["bench/gpu_train_speed.py", "--smoke", "--precision", "bf16"])
    report = _run(["bench/gpu_train_speed.py", "--smoke", "--precision", "bf16", *flags])
    assert report["half_weights"] and report["finite"]
    assert report["cuda_graphs"] == ("--cuda-graphs" in flags)
    assert report["max_buckets"] == (1 if "--max-buckets" in flags else 0)
    assert report["loss_per_token_first_update"] == pytest.approx(
        base["loss_per_token_first_update"], abs=0.02)


def test_base_micro_batch_dispatches_a_third_of_what_the_first_gpu_run_did():
    """Along the GPU's code path, one base micro-batch (forward and backward, one process,
    the bf16 copy as `nmt train` builds it on CUDA) dispatches at most a third of the 3,330
    ops counted after the first GPU visit, with no cast of a weight; under autocast the
    weights are cast in every micro-batch. Op counts do not depend on the batch size."""
    sys.path.insert(0, str(REPO / "bench"))
    import _count_ops
    import torch

    from nmt.config import model_preset
    from nmt.model.transformer import Transformer
    from nmt.train.half import HalfWeights
    from nmt.train.step import LossOptions

    torch.manual_seed(0)
    cfg = model_preset("base", vocab_size=37000)
    model = Transformer(cfg)
    half = HalfWeights(model, pad_vocab=True, rows_linears=True)
    micro = _count_ops.synthetic_micro(4, 12, 37000, torch.device("cpu"))
    loss = LossOptions(0.1, cfg.pad_id)
    counted = _count_ops.count_micro(model, half.model, half, micro, loss)
    assert counted.ops <= 3330 // 3 and counted.weight_casts == 0, counted.by_op
    assert counted.matmuls >= 6 * 4 * 3 + 6 * 6 * 3  # every linear forward and backward
    eager = _count_ops.count_micro(model, model, None, micro, loss)
    assert eager.weight_casts > 0 and eager.ops > counted.ops
