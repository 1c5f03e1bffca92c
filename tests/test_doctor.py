"""`nmt doctor`: the facts a bug report and a benchmark record need, as text and as JSON."""

from __future__ import annotations

import json

import pytest
import torch

from nmt import kernels
from nmt.doctor import report, text
from nmt.kernels.levels import KERNELS
from nmt.precision import resolve_precision


@pytest.fixture(scope="module")
def facts() -> dict:
    return report(measure=True)


def test_the_report_says_what_the_library_does_here(facts: dict) -> None:
    assert facts["cpu"]["class"] == kernels.cpu_class()
    assert set(facts["cpu"]["flags"]) <= kernels.cpu_flags()
    assert facts["cpu"]["caps"] == kernels.caps()
    assert set(facts["kernels"]) == set(KERNELS)
    for name, kernel in facts["kernels"].items():
        assert kernel["note"]
        assert kernel["level"] is None or kernel["level"] in kernel["built"], name
    assert facts["precision"]["cpu_auto"] == resolve_precision("auto", torch.device("cpu"))
    if "measured" in facts["precision"]:
        measured = facts["precision"]["measured"]
        assert measured["fp32_ms"] > 0 and measured["bf16_ms"] > 0
        assert isinstance(facts["precision"]["agrees"], bool)
    assert facts["torch"]["version"] == torch.__version__
    assert facts["threads"]["torch_intra_op"] == torch.get_num_threads()
    assert facts["gpus"]["available"] == torch.cuda.is_available()
    assert set(facts["extras"]) == {"ct2", "serve", "hf", "tensorboard", "plot"}


def test_the_text_names_every_kernel_the_class_and_the_precision_rule(facts: dict) -> None:
    lines = text(facts).splitlines()
    assert lines[:2] == ["nmt:", f"  version: {facts['nmt']['version']}"]
    assert f"  class: {facts['cpu']['class']}" in lines
    for name in KERNELS:
        assert f"  {name}:" in lines, name
    assert f"  cpu_auto: {facts['precision']['cpu_auto']}" in lines
    assert f"  column: {facts['backends']['column']}" in lines
    assert all(": " in line or line.endswith(":") for line in lines)


def test_the_cli_prints_json_on_stdout(nmt_cli) -> None:
    result = nmt_cli.invoke("doctor", "--json", "--no-measure")
    assert result.returncode == 0, result.err
    facts = json.loads(result.out)
    assert "measured" not in facts["precision"]
    assert facts["cpu"]["class"] == kernels.cpu_class()
    plain = nmt_cli.invoke("doctor", "--no-measure")
    assert plain.returncode == 0 and plain.out.startswith("nmt:\n  version: ")


def test_caps_show_as_the_class_and_in_the_settings(monkeypatch) -> None:
    monkeypatch.setenv("ATEN_CPU_CAPABILITY", "default")
    facts = report(measure=False)
    assert facts["cpu"]["class"] == "baseline"
    assert facts["cpu"]["caps"] == {"ATEN_CPU_CAPABILITY": "baseline"}
    assert facts["settings"]["ATEN_CPU_CAPABILITY"] == "default"


def test_the_report_says_which_backend_runs_each_row(facts: dict) -> None:
    """The backends section: this CPU's column, and for every row of the table one of the
    backends its cell lists (or, for int8 without torch's kernels, the fp32 row's)."""
    from nmt.inference import backends

    section = facts["backends"]
    assert section["column"] == backends.column()
    rows = {f"{operation} {precision}": cells[backends.COLUMNS.index(section["column"])]
            for (operation, precision), cells in backends.TABLE.items()}
    assert section["runs"].keys() == rows.keys()
    for row, chosen in section["runs"].items():
        fp32 = section["runs"].get(row.replace("int8", "fp32"))
        assert chosen in rows[row] or chosen == fp32, row
    lines = text(facts).splitlines()
    for row, chosen in section["runs"].items():
        assert f"    {row}: {chosen}" in lines, row
