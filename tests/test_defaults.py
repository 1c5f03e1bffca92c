"""One definition per default: every default lives in nmt/config.py; the CLI's
options show and use exactly those values, and no other module repeats the paper's
decoding numbers as literals."""

from __future__ import annotations

import ast
import inspect
from pathlib import Path

import pytest
import typer.models

from nmt.config import DEVICES, DecodeConfig, RuntimeConfig, TrainConfig

REPO = Path(__file__).resolve().parents[1]


def _options(command) -> dict[str, typer.models.OptionInfo]:
    return {name: p.default for name, p in inspect.signature(command).parameters.items()
            if isinstance(p.default, typer.models.OptionInfo)}


def test_translate_cli_options_are_decode_and_runtime_config_fields():
    """Every DecodeConfig and RuntimeConfig field is an option of `nmt translate`, None
    when not given (the config's default then holds) and showing the config's default."""
    from nmt.cli.translate import command

    options = _options(command)
    fields = {**DecodeConfig().__dict__, **RuntimeConfig().__dict__}
    assert set(fields) <= set(options)
    for name, value in fields.items():
        info = options[name]
        assert info.default is None, name
        if name != "max_tokens":  # resolved by device: shown as the rule
            assert info.show_default == str(value), name


def test_train_cli_shows_train_config_defaults():
    """Train options default to None (so recipes can fill them) and show the config's
    value in --help: that shown value must be TrainConfig's."""
    from nmt.cli.train import command

    options = _options(command)
    fields = TrainConfig().__dict__
    for name in set(options) & set(fields):
        info = options[name]
        assert info.default is None, name  # None: not given, so recipe/config decide
        if isinstance(info.show_default, str) and name not in ("batch_tokens",
                                                                "valid_beam"):
            assert info.show_default == str(fields[name]), name
    assert options["device"].default == DEVICES[0]


@pytest.mark.parametrize("literal", ["max_len_b=50", "alpha=0.6", "beam=4",
                                     'precision="fp32"', "max_len_a=1.0"])
def test_no_module_repeats_a_decoding_default(literal):
    """Keyword defaults spelled out again outside nmt/config.py would drift apart."""
    key, value = literal.split("=")
    for path in (REPO / "nmt").rglob("*.py"):
        if path.name == "config.py":
            continue
        tree = ast.parse(path.read_text(encoding="utf-8"))
        for node in ast.walk(tree):
            pairs = []
            if isinstance(node, ast.Call):
                pairs = [(k.arg, k.value) for k in node.keywords]
            elif isinstance(node, ast.arguments):
                args = node.args[len(node.args) - len(node.defaults):]
                pairs = [(a.arg, d) for a, d in zip(args, node.defaults, strict=True)]
                pairs += [(a.arg, d) for a, d in zip(node.kwonlyargs, node.kw_defaults,
                                                     strict=True) if d is not None]
            for arg, default in pairs:
                if arg == key and isinstance(default, ast.Constant) and \
                        repr(default.value).strip("'\"") == value.strip('"'):
                    raise AssertionError(f"{path.relative_to(REPO)}:{node.lineno}: "
                                         f"{literal} repeats nmt/config.py's default")
