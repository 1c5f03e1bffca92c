"""Where training settings come from: config defaults, then the recipe, then flags.

`nmt.config` holds every default; a recipe's `[training]` table overrides it for its data
(e.g. the Multi30k schedule); flags given on the command line override both. The data
directory's manifest names its recipe, so `nmt train DATA` finds the recipe's settings.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

from nmt.config import DEFAULT_ARCH, SETTABLE_MODEL_FIELDS, ModelConfig, TrainConfig, model_preset
from nmt.errors import NmtError

_TRAIN_FIELDS = {f.name for f in dataclasses.fields(TrainConfig)}


def recipe_training(data_dir: Path) -> tuple[dict[str, Any], str | None]:
    """The `[training]` table of DATA's recipe and the recipe's name ({} if none)."""
    from nmt.data.recipes import load_recipe

    try:
        manifest = json.loads((Path(data_dir) / "manifest.json").read_text("utf-8"))
    except (OSError, ValueError):
        return {}, None
    for ref in (manifest.get("recipe_file"), manifest.get("recipe")):
        if not ref:
            continue
        try:
            recipe = load_recipe(str(ref))
        except NmtError:
            continue
        return dict(recipe.training), recipe.name
    return {}, None


def resolve(data_dir: Path, arch: str | None, model_flags: dict[str, Any],
            train_flags: dict[str, Any]) -> tuple[ModelConfig, TrainConfig, dict[str, str]]:
    """Build the configs; flags with value None were not given. Returns (model, train,
    sources): for each setting not at its default, `value (origin)` with origin 'flag' or
    'recipe NAME', for the start-up log line."""
    recipe, name = recipe_training(data_dir)
    sources: dict[str, str] = {}
    per_arch: dict[str, Any] = {}

    def pick(key: str, flag: Any) -> Any:
        if flag is not None:
            sources[key] = f"{flag} (flag)"
            return flag
        if key in recipe:
            where = f" [training.{arch_name}]" if key in per_arch else ""
            sources[key] = f"{recipe[key]} (recipe {name}{where})"
            return recipe[key]
        return None

    arch_name = pick("arch", arch) or DEFAULT_ARCH
    # Values of the recipe's [training.ARCH] table override its [training] ones.
    per_arch = recipe.get(arch_name, {})
    recipe = {k: v for k, v in recipe.items() if not isinstance(v, dict)} | per_arch
    model_values = {k: pick(k, model_flags.get(k)) for k in SETTABLE_MODEL_FIELDS}
    train_values = {k: pick(k, train_flags.get(k)) for k in _TRAIN_FIELDS}
    model_cfg = model_preset(arch_name, **model_values)
    train_cfg = TrainConfig(**{k: v for k, v in train_values.items() if v is not None})
    return model_cfg, train_cfg, sources
