"""Settings precedence: nmt.config defaults < recipe [training] < command-line flags."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from helpers.cli import NmtCli

from nmt.config import ModelConfig, TrainConfig
from nmt.data.recipes import load_recipe
from nmt.errors import UsageError
from nmt.train.settings import resolve

RECIPE = """
name = "toy"
src_lang = "en"
tgt_lang = "de"
vocab_size = 100
[archives.a]
url = "https://example.org/a.txt"
[train]
src = {{ archive = "a" }}
tgt = {{ archive = "a" }}
[valid]
src = {{ archive = "a" }}
tgt = {{ archive = "a" }}
[test]
src = {{ archive = "a" }}
tgt = {{ archive = "a" }}
[training]
{training}
"""


def _data_dir(tmp_path: Path, training: str) -> Path:
    recipe = tmp_path / "toy.toml"
    recipe.write_text(RECIPE.format(training=training), encoding="utf-8")
    data = tmp_path / "data"
    data.mkdir()
    (data / "manifest.json").write_text(json.dumps({"recipe": "toy",
                                                    "recipe_file": str(recipe)}))
    return data


def test_defaults_without_recipe(tmp_path: Path) -> None:
    model, train, sources = resolve(tmp_path, None, {}, {})
    assert (model.d_model, model.encoder_layers) == (512, 6)  # base
    assert train == TrainConfig()
    assert sources == {}


def test_recipe_overrides_defaults_and_flags_override_recipe(tmp_path: Path) -> None:
    data = _data_dir(tmp_path, 'arch = "small"\nwarmup = 800\ndropout = 0.2\nmax_tokens = 3000')
    model, train, sources = resolve(data, None, {"dropout": None}, {"max_tokens": 1234})
    assert model.d_model == 256 and model.encoder_layers == 3  # recipe arch small
    assert model.dropout == 0.2  # recipe
    assert train.warmup == 800  # recipe
    assert train.max_tokens == 1234  # flag beats recipe
    assert train.lr_scale == TrainConfig().lr_scale  # default
    assert sources == {"arch": "small (recipe toy)", "warmup": "800 (recipe toy)",
                       "dropout": "0.2 (recipe toy)", "max_tokens": "1234 (flag)"}
    model, _, _ = resolve(data, "tiny", {"dropout": 0.05}, {})
    assert model.d_model == ModelConfig(**{**ModelConfig().to_dict(), "d_model": 64}).d_model
    assert model.dropout == 0.05


@pytest.mark.parametrize("line, message", [
    ("warmpu = 10", "training.warmpu: unknown key"),
    ('warmup = "ten"', "training.warmup: must be a int"),
    ('arch = "huge"', "unknown arch 'huge'"),
    ("vocab_size = 10", "training.vocab_size: unknown key"),
])
def test_bad_training_table_is_a_usage_error(tmp_path: Path, line: str, message: str) -> None:
    data = _data_dir(tmp_path, line)
    with pytest.raises(UsageError, match=message):
        load_recipe(str(tmp_path / "toy.toml"))
    assert data.is_dir()


def test_shipped_multi30k_recipe_has_a_valid_schedule(tmp_path: Path) -> None:
    training = load_recipe("multi30k-en-de").training
    assert training["arch"] == "small"
    (tmp_path / "manifest.json").write_text(json.dumps({"recipe": "multi30k-en-de"}))
    model, train, sources = resolve(tmp_path, None, {}, {})
    assert (model.d_model, model.d_ff, model.heads, model.encoder_layers) == (256, 1024, 4, 3)
    assert train.warmup == training["warmup"] and train.lr_scale == training["lr_scale"]
    assert set(sources) == set(training)


def test_per_arch_table_applies_only_to_that_arch(tmp_path: Path) -> None:
    data = _data_dir(tmp_path, "max_updates = 100000\nkeep_last = 5\n"
                               "[training.big]\nmax_updates = 300000\nkeep_last = 20\n"
                               "dropout = 0.1")
    model, train, sources = resolve(data, None, {}, {})  # base (the default arch)
    assert (train.max_updates, train.keep_last, model.dropout) == (100000, 5, 0.1)
    model, train, sources = resolve(data, "big", {}, {"keep_last": 7})
    assert (train.max_updates, train.keep_last, model.dropout) == (300000, 7, 0.1)
    assert sources["max_updates"] == "300000 (recipe toy [training.big])"
    assert sources["keep_last"] == "7 (flag)"
    assert "dropout" in sources  # big's preset says 0.3; the recipe's table says 0.1


@pytest.mark.parametrize("table, message", [
    ("[training.huge]\nwarmup = 1", "training.huge: unknown key"),
    ("[training.big]\nwarmpu = 1", "training.big.warmpu: unknown key"),
    ('[training.big]\narch = "base"', "training.big.arch: unknown key"),
    ("[training.big]\n[training.big.base]\nwarmup = 1", "training.big.base: unknown key"),
])
def test_bad_per_arch_table_is_a_usage_error(tmp_path: Path, table: str, message: str) -> None:
    _data_dir(tmp_path, table)
    with pytest.raises(UsageError, match=message):
        load_recipe(str(tmp_path / "toy.toml"))


@pytest.mark.parametrize("recipe, big_dropout", [("wmt14-en-de", 0.3), ("wmt14-en-fr", 0.1)])
def test_shipped_wmt_recipes_carry_the_papers_gpu_schedule(tmp_path: Path, recipe: str,
                                                           big_dropout: float) -> None:
    (tmp_path / "manifest.json").write_text(json.dumps({"recipe": recipe}))
    model, train, _ = resolve(tmp_path, None, {}, {})
    assert (model.d_model, model.dropout) == (512, 0.1)  # base
    assert (train.batch_tokens, train.warmup, train.lr_scale, train.label_smoothing) == (
        25000, 4000, 1.0, 0.1)
    assert train.max_tokens == 0 and train.precision == "auto"  # 0: planned from the GPU
    assert (train.max_updates, train.save_interval_minutes, train.keep_last) == (100000, 10, 20)
    model, train, sources = resolve(tmp_path, "big", {}, {})
    assert (model.d_model, model.dropout, train.max_updates) == (1024, big_dropout, 300000)
    assert sources["max_updates"].endswith(f"(recipe {recipe} [training.big])")


@pytest.mark.parametrize(("flag", "value", "message"), [
    ("--max-updates", "-3", "max-updates must be positive"),
    ("--max-updates", "0", "max-updates must be positive"),
    ("--max-epochs", "-1", "max-epochs must be >= 0"),
    ("--max-minutes", "-5", "max-minutes must be >= 0"),
    ("--save-interval-updates", "-10", "save-interval-updates must be >= 0"),
    ("--save-interval-minutes", "-1", "save-interval-minutes must be >= 0"),
    ("--batch-tokens", "-100", "batch-tokens must be positive"),
    ("--lr-scale", "0", "lr-scale must be positive"),
    ("--clip-norm", "-1", "clip-norm must be >= 0"),
    ("--weight-decay", "-0.1", "weight-decay must be >= 0"),
    ("--adam-beta2", "1.0", "adam-beta2 must be in [0, 1)"),
    ("--seed", "-1", "seed must be >= 0"),
])
def test_negative_counts_and_sizes_are_usage_errors(tmp_path: Path, flag: str, value: str,
                                                     message: str, nmt_cli: NmtCli) -> None:
    """`nmt train ... --max-updates -3` used to train nothing, save checkpoint_0.pt and
    exit 0: every count and size is checked before anything is written."""
    run = tmp_path / "run"
    result = nmt_cli.invoke("train", str(_data_dir(tmp_path, "")), "-o", str(run), flag, value)
    lines = result.stderr.decode().strip().splitlines()
    assert result.returncode == 2, result.stderr
    assert len(lines) == 1 and message in lines[0], lines
    assert not run.exists()


@pytest.mark.parametrize(("field", "value"), [("max_len_a", -1.0), ("max_len_b", -1),
                                              ("top_k", -2), ("seed", -1)])
def test_decode_and_runtime_configs_refuse_negative_values(field: str, value: float) -> None:
    from nmt.config import DecodeConfig, RuntimeConfig

    config = RuntimeConfig if field == "seed" else DecodeConfig
    with pytest.raises(UsageError, match=f"{field.replace('_', '-')} must be >= 0"):
        config(**{field: value})


@pytest.mark.parametrize(("field", "value"), [("device", "tpu"), ("precision", "fp8"),
                                              ("weights", "best"), ("errors", "ignore")])
def test_runtime_config_refuses_unknown_choices(field: str, value: str) -> None:
    from nmt.config import RuntimeConfig

    with pytest.raises(UsageError, match=f"unknown --{field} '{value}'; choose one of: "):
        RuntimeConfig(**{field: value})


def test_start_up_line_names_init_from_and_reset_optimizer(tmp_path: Path, nmt_cli: NmtCli) -> None:
    init = tmp_path / "parent.pt"
    result = nmt_cli.invoke("train", str(_data_dir(tmp_path, "")), "-o", str(tmp_path / "run"),
                            "--init-from", str(init), "--reset-optimizer")
    first = result.stderr.decode().splitlines()[0]
    assert first.startswith("nmt train: settings not at their defaults: "), first
    assert f"init_from={init} (flag)" in first and "reset_optimizer=True (flag)" in first


def test_help_shows_no_value_type_for_flags_and_keeps_extras_names(nmt_cli: NmtCli) -> None:
    """Flags take no value, so no `<bool>` beside them; `nmt[plot]` is not eaten as markup."""
    top = nmt_cli.invoke("--help").stdout.decode()
    assert "--version" in top and "<bool>" not in top
    assert "nmt[plot]" in top and "nmt[ct2]" in top
    for command in ("train", "translate", "score", "prep"):
        text = nmt_cli.invoke(command, "--help").stdout.decode()
        assert "<bool>" not in text, command
        assert "<int>" in text or "<float>" in text or "<path>" in text, command
