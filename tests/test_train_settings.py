"""Settings precedence: nmt.config defaults < recipe [training] < command-line flags."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from nmt.config import ModelConfig, TrainConfig
from nmt.errors import UsageError
from nmt.recipes import load_recipe
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
