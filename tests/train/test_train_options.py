"""`nmt train`'s options come from the config dataclasses: each
TrainConfig field and each settable ModelConfig field is a flag named, explained and shown
with its default by the field's metadata, with no list of them in cli/train.py."""

from __future__ import annotations

import dataclasses
import inspect

import pytest
import torch
import typer
import typer.models
from helpers.cli import NMT_CLI, assert_one_line
from typer.testing import CliRunner

from nmt.cli.options import config_options
from nmt.cli.train import command
from nmt.config import (
    MODEL_PRESETS,
    SETTABLE_MODEL_FIELDS,
    DecodeConfig,
    ModelConfig,
    TrainConfig,
)

RUNNER = CliRunner()  # for a throwaway Typer app; the nmt CLI runs through NMT_CLI
WIDE = {"COLUMNS": "300"}  # one line per option in the rich help
TRAIN_FIELDS = dataclasses.fields(TrainConfig)
MODEL_FIELDS = [f for f in dataclasses.fields(ModelConfig) if f.name in SETTABLE_MODEL_FIELDS]


def _options() -> dict[str, typer.models.OptionInfo]:
    return {name: p.default for name, p in inspect.signature(command).parameters.items()
            if isinstance(p.default, typer.models.OptionInfo)}


def _help() -> str:
    result = NMT_CLI.invoke("train", "--help", env=WIDE)
    assert result.returncode == 0, result.output
    return result.output


def test_every_config_field_has_help_and_a_flag_in_the_help():
    text = _help()
    options = _options()
    for field in (*TRAIN_FIELDS, *MODEL_FIELDS):
        assert field.metadata.get("help"), f"{field.name}: no help metadata"
        info = options[field.name]
        assert info.help == field.metadata["help"], field.name
        for flag in info.param_decls[0].split("/"):
            assert f" {flag} " in text, flag
    # fields set from the data, not by flags
    assert "vocab_size" not in options and "pad_id" not in options


def test_options_default_to_none_and_show_the_config_default():
    """None: not given, so the recipe or the config decides; --help shows the paper's."""
    options = _options()
    for field in TRAIN_FIELDS:
        info = options[field.name]
        assert info.default is None, field.name
        assert info.show_default == field.metadata.get("shown_default", str(field.default))
    for field in MODEL_FIELDS:
        info = options[field.name]
        assert info.default is None, field.name
        presets = ", ".join(f"{arch} {preset.get(field.name, field.default)}"
                            for arch, preset in MODEL_PRESETS.items())  # the arch's value
        expected = field.metadata.get("shown_default", f"from --arch ({presets})")
        assert info.show_default == expected, field.name
    assert f"({DecodeConfig().beam})" in options["valid_beam"].show_default
    text = _help()
    assert "--warmup" in text and f"[default: ({TrainConfig().warmup})]" in text


def test_flags_and_aliases_that_are_no_config_field_stay():
    text = _help()
    for flag in ("-o", "--output", "--arch", "--init-from", "--reset-optimizer", "--device",
                 "--gpus", "--nproc", "--nnodes", "--rdzv-endpoint", "--learned-positions",
                 "--sinusoidal-positions", "--pre-norm", "--post-norm", "--valid-bleu",
                 "--no-valid-bleu"):
        assert f" {flag} " in text, flag
    names = list(inspect.signature(command).parameters)
    assert names[:3] == ["data", "output", "arch"]  # model and train options follow arch
    assert names[3:3 + len(MODEL_FIELDS)] == [f.name for f in MODEL_FIELDS]


def test_a_new_documented_field_becomes_a_flag_with_no_cli_edit():
    @dataclasses.dataclass(frozen=True)
    class Extra:
        new_knob: int | None = dataclasses.field(default=3, metadata={"help": "A knob."})
        switch: bool = dataclasses.field(default=False, metadata={"help": "A switch."})
        mode: str = dataclasses.field(default="a", metadata={"help": "A mode.",
                                                             "flag": "--the-mode",
                                                             "shown_default": "first"})

    params = config_options(Extra)
    assert [p.name for p in params] == ["new_knob", "switch", "mode"]
    assert [p.default.param_decls for p in params] == [
        ("--new-knob",), ("--switch/--no-switch",), ("--the-mode",)]
    assert [p.default.show_default for p in params] == ["3", "False", "first"]
    assert [p.annotation for p in params] == [int, bool, str]
    assert all(p.default.default is None for p in params)

    seen: dict[str, object] = {}

    def knobs(**settings: object) -> None:
        seen.update(settings)

    knobs.__signature__ = inspect.Signature(params)  # type: ignore[attr-defined]
    one = typer.Typer()
    one.command()(knobs)
    result = RUNNER.invoke(one, ["--new-knob", "5", "--switch"])
    assert result.exit_code == 0, result.output
    assert seen == {"new_knob": 5, "switch": True, "mode": None}


@pytest.mark.parametrize("args, message", [
    (["--max-updates", "-3"], "max-updates must be positive, got -3"),
    (["--precision", "fp8"], "unknown precision 'fp8'"),
    (["--heads", "7"], "is not divisible by heads 7"),
    (["--fused-loss", "maybe"], "unknown fused-loss 'maybe'; choose one of: auto, on, off"),
])
def test_a_bad_value_is_one_line_and_exit_2(tmp_path, args, message):
    result = NMT_CLI.invoke("train", tmp_path / "data", "-o", tmp_path / "r", *args)
    assert_one_line(result, 2, message)
    assert not (tmp_path / "r").exists()


def test_fused_loss_is_a_choice_with_auto_decided_by_the_device():
    """--fused-loss: the chunked projected loss is chosen, not forced by the device type."""
    from nmt.train.loss import fused_loss_enabled

    cpu, cuda = torch.device("cpu"), torch.device("cuda", 0)
    assert fused_loss_enabled("auto", cuda) and not fused_loss_enabled("auto", cpu)
    assert fused_loss_enabled("on", cpu) and not fused_loss_enabled("off", cuda)


def test_the_trainer_takes_the_fused_loss_choice(tmp_path):
    from helpers.data import make_copy_data

    from nmt.config import TrainConfig, model_preset
    from nmt.train.loop import Trainer

    data = make_copy_data(tmp_path / "data", n_train=40, n_valid=8)
    for choice, fused in (("on", True), ("off", False), ("auto", False)):  # auto: CPU
        trainer = Trainer(data, tmp_path / choice, model_preset("tiny"),
                          TrainConfig(fused_loss=choice, max_tokens=256, max_len=32), "cpu",
                          progress=False)
        assert trainer.fused_loss is fused and trainer.loss_options.fused is fused
