"""`nmt tune` (nmt/inference/tune.py, cli/tune.py) and the run's decoding.json
(nmt/inference/tuned.py): the rules on known scores, a flat model keeping the paper's alpha,
the choice used by `nmt translate -m RUN`, the Python API and `nmt serve`, an explicit
--alpha winning, and a broken decoding.json named in one line."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest
from helpers.cli import NmtCli, assert_one_line

from nmt.errors import DataError, UsageError
from nmt.inference.tune import (
    FLAT_BLEU,
    PAPER_ALPHA,
    Trial,
    choose,
    corpus_ratio,
    parse_values,
    score_trial,
)

pytestmark = pytest.mark.usefixtures("one_thread")
SHORT_FLAGS = ("--max-len-a", "0", "--max-len-b", "8", "--precision", "fp32")


def _trial(alpha: float, precisions: tuple[float, ...], hyp_len: int, ref_len: int = 1000,
           src_len: int = 1000, beam: int = 4) -> Trial:
    """A trial with these n-gram precisions and lengths (BLEU computed as sacreBLEU does)."""
    totals = tuple(hyp_len - n for n in range(4))
    counts = tuple(round(p * t) for p, t in zip(precisions, totals, strict=True))
    log_p = sum(math.log(c / t) for c, t in zip(counts, totals, strict=True)) / 4
    bp = 1.0 if hyp_len >= ref_len else math.exp(1 - ref_len / hyp_len)
    return Trial(alpha, beam, 100 * bp * math.exp(log_p), 50.0, bp, hyp_len, ref_len,
                 src_len, counts, totals)


def test_bleu_at_length_is_sacrebleus_bleu_at_the_references_length() -> None:
    hyps = ["a man rides a red bike .", "two dogs play in the snow"]
    refs = ["a man rides a bike .", "two dogs are playing in the snow ."]
    trial = score_trial(1.0, 4, hyps, refs, ["x y z"] * 2)
    assert trial.bleu_at_length(trial.ref_len) == pytest.approx(trial.bleu, abs=1e-3)
    assert trial.bleu_at_length(0) >= trial.bleu  # no brevity penalty at all
    assert trial.src_len == 6 and trial.ratio == trial.hyp_len / trial.ref_len


def test_corpus_length_rule_judges_length_by_the_corpus_not_the_dev_references() -> None:
    """Dev references 8 % longer than the corpus's ratio expects: dev BLEU's arg-max takes
    the long output, the corpus-length rule the one of the corpus's length."""
    same = (0.7, 0.5, 0.35, 0.25)
    trials = [_trial(0.6, same, 900, ref_len=1080), _trial(1.0, same, 1000, ref_len=1080),
              _trial(1.4, (0.69, 0.49, 0.345, 0.245), 1080, ref_len=1080)]
    assert choose(trials, 1.0, "dev-bleu").alpha == 1.4
    pick = choose(trials, 1.0, "corpus-length")
    assert pick.alpha == 1.0 and "1.000" in pick.why
    assert choose(trials, 1.0, "length").alpha == 1.0
    assert choose(trials, 0.9, "length").alpha == PAPER_ALPHA


def test_no_ramble_rules_leave_out_an_alpha_whose_output_rambles() -> None:
    """Valid's longer references reward the alpha at which an under-trained model starts
    repeating itself; the no-ramble rules leave it out and take the best of the rest, while a
    well-trained model's small rise in repeats keeps every alpha in."""
    import dataclasses

    from nmt.inference.tune import RAMBLE_POINTS, repeats

    assert repeats(["a man in a blue shirt in a blue shirt"]) == pytest.approx(300 / 9)
    assert repeats(["two dogs play", ""]) == 0.0
    base = [_trial(0.6, (0.7, 0.5, 0.35, 0.25), 900, ref_len=1080),
            _trial(1.0, (0.7, 0.5, 0.35, 0.25), 1000, ref_len=1080),
            _trial(1.4, (0.69, 0.49, 0.345, 0.245), 1080, ref_len=1080)]
    rambling = [dataclasses.replace(t, repeats=1.0 + (3.0 if t.alpha == 1.4 else 0.0))
                for t in base]
    assert choose(rambling, 1.0, "dev-bleu").alpha == 1.4
    pick = choose(rambling, 1.0, "no-ramble")
    assert pick.alpha == 1.0 and "rambling at alpha 1.4" in pick.why
    assert choose(rambling, 1.0, "no-ramble-corpus").alpha == 1.0
    calm = [dataclasses.replace(t, repeats=1.0 + (RAMBLE_POINTS / 2 if t.alpha == 1.4 else 0))
            for t in base]
    assert choose(calm, 1.0, "no-ramble").alpha == 1.4


def test_flat_scores_keep_the_papers_alpha() -> None:
    same = (0.5, 0.3, 0.2, 0.1)
    trials = [_trial(a, same, n) for a, n in ((0.6, 1000), (1.0, 1001), (1.4, 1002))]
    for rule in ("corpus-length", "dev-bleu", "chrf", "precision", "no-ramble",
                 "no-ramble-corpus"):
        pick = choose(trials, 1.0, rule)
        assert pick.alpha == PAPER_ALPHA, (rule, pick)
    better = (0.5 * 1.02, 0.3 * 1.02, 0.2 * 1.02, 0.1 * 1.02)  # ~ +FLAT_BLEU and more
    trials[2] = _trial(1.4, better, 1002)
    assert trials[2].bleu - trials[0].bleu > FLAT_BLEU
    assert choose(trials, 1.0, "dev-bleu").alpha == 1.4


def test_values_rules_and_corpus_ratio_reject_bad_input(tmp_path: Path) -> None:
    assert parse_values("1.0, 0.6,1.0", float, "--alphas") == [0.6, 1.0]
    assert parse_values("4,6", int, "--beams") == [4, 6]
    for text, kind in (("0.6,x", float), ("", float), ("0", int), ("-1", float)):
        with pytest.raises(UsageError):
            parse_values(text, kind, "--alphas")
    with pytest.raises(UsageError, match="unknown rule"):
        choose([_trial(0.6, (0.5, 0.3, 0.2, 0.1), 900)], 1.0, "best")
    src, tgt = tmp_path / "train.src", tmp_path / "train.tgt"
    src.write_text("a b c d\ne f\n", encoding="utf-8")
    tgt.write_text("a b c\nd e f\n", encoding="utf-8")
    assert corpus_ratio(src, tgt) == 1.0
    tgt.write_text("a b c\n", encoding="utf-8")
    with pytest.raises(DataError, match="as many target lines"):
        corpus_ratio(src, tgt)
    with pytest.raises(DataError, match="--data DIR"):
        corpus_ratio(tmp_path / "missing.src", tgt)


@pytest.fixture
def run(tiny_checkpoint: Path, tmp_path: Path) -> Path:
    """A run directory holding the tiny random-init model as its average.pt."""
    run = tmp_path / "run"
    run.mkdir()
    shutil.copy(tiny_checkpoint, run / "average.pt")
    return run


@pytest.fixture
def dev(tmp_path: Path) -> tuple[Path, Path]:
    from conftest import shared_data_path

    base = shared_data_path("multi30k")
    out = []
    for name, ext in (("val.en", "src"), ("val.de", "ref")):
        path = tmp_path / f"dev.{ext}"
        lines = (base / name).read_text(encoding="utf-8").split("\n")[:12]
        path.write_text("\n".join(lines) + "\n", encoding="utf-8")
        out.append(path)
    return out[0], out[1]


def test_tune_on_a_flat_model_keeps_the_papers_alpha_and_writes_decoding_json(
        run: Path, dev: tuple[Path, Path], nmt_cli: NmtCli) -> None:
    """A random-init model scores about nothing at every alpha: flat, so 0.6 stays; the
    table and the choice are printed and kept in RUN/decoding.json."""
    result = nmt_cli.run("tune", "-m", run, "--dev", f"{dev[0]},{dev[1]}", "--ratio", "1.0",
                         "--alphas", "0.6,1.4", *SHORT_FLAGS[-2:])
    assert result.returncode == 0, result.err
    assert "alpha" in result.out and "chose alpha 0.6, beam 4" in result.out
    assert len([line for line in result.out.splitlines() if line.startswith(("  0.6",
                                                                             "  1.4"))]) == 2
    data = json.loads((run / "decoding.json").read_text(encoding="utf-8"))
    assert data["settings"] == {"alpha": 0.6, "beam": 4} and data["rule"] == "no-ramble"
    assert [t["alpha"] for t in data["trials"]] == [0.6, 1.4]
    assert data["model"] == "average.pt" and data["dev"]["lines"] == 12
    dry = nmt_cli.run("tune", "-m", run, "--dev", f"{dev[0]},{dev[1]}", "--ratio", "1.0",
                      "--alphas", "1.0", "--dry-run", *SHORT_FLAGS[-2:])
    assert dry.returncode == 0 and json.loads((run / "decoding.json").read_text())["trials"] \
        == data["trials"]  # --dry-run wrote nothing


def test_tune_names_what_is_missing_in_one_line(run: Path, dev: tuple[Path, Path],
                                                nmt_cli: NmtCli, tmp_path: Path) -> None:
    for args, code, word in (
            (["--dev", str(dev[0])], 2, "SRC,REF"),
            (["--dev", f"{dev[0]},{tmp_path / 'nope.de'}", "--ratio", "1"], 3, "nope.de"),
            (["--alphas", "a,b", "--ratio", "1"], 2, "--alphas"),
            (["--rule", "best", "--ratio", "1"], 2, "--rule"),
            (["--data", str(tmp_path)], 3, "valid.src")):
        assert_one_line(nmt_cli.run("tune", "-m", run / "average.pt", *args), code, word)


def _decoding(run: Path, alpha: float, beam: int = 4) -> None:
    from nmt.inference.tuned import write_decoding

    write_decoding(run, {"alpha": alpha, "beam": beam}, {"rule": "test"})


def test_translate_api_and_serve_use_decoding_json_and_given_options_win(
        run: Path, nmt_cli: NmtCli) -> None:
    """With alpha 1.4 in decoding.json, `nmt translate -m RUN` prints what `--alpha 1.4`
    prints (and says so on stderr), `--alpha 0.6` wins over the file, and the API and the
    server's model list carry it: n-best scores are those of alpha 1.4."""
    from nmt import Translator

    text = "A man rides a bike.\nTwo dogs play.\n"
    nbest = ("--nbest", "2", *SHORT_FLAGS)
    plain = nmt_cli.run("translate", "-m", run, *nbest, input=text)
    explicit = nmt_cli.run("translate", "-m", run, *nbest, "--alpha", "1.4", input=text)
    assert plain.returncode == explicit.returncode == 0 and plain.out != explicit.out
    _decoding(run, 1.4)
    tuned = nmt_cli.run("translate", "-m", run, *nbest, input=text)
    assert tuned.returncode == 0 and tuned.out == explicit.out
    assert "alpha 1.4" in tuned.err and "decoding.json" in tuned.err
    given = nmt_cli.run("translate", "-m", run, *nbest, "--alpha", "0.6", input=text)
    assert given.out == plain.out and "decoding with beam 4 from" in given.err
    by_file = nmt_cli.run("translate", "-m", run / "average.pt", *nbest, input=text)
    assert by_file.out == explicit.out  # a checkpoint inside the run: the same choice

    with Translator.load(run, precision="fp32", quiet=True) as translator:
        assert translator.tuned == {"alpha": 1.4, "beam": 4}
        lines = ["A man rides a bike.", "Two dogs play."]

        def scores(**options: object) -> list[float]:
            return [h.score for r in translator.translate_hypotheses(
                lines, nbest=2, max_len_a=0.0, max_len_b=8, **options) for h in r.hypotheses]

        with_tuned = scores()
        assert with_tuned == scores(alpha=1.4) != scores(alpha=0.6)

    from helpers.serving import Server

    server = Server("-m", run)
    try:
        status, listed, _ = server.get("/v1/models")
        assert status == 200 and listed[0]["decoding"] == {"alpha": 1.4, "beam": 4}
        status, got, _ = server.post("/v1/translate", {
            "inputs": lines, "nbest": 2, "return_scores": True, "max_len_a": 0.0,
            "max_len_b": 8})
        assert status == 200, got
        served = [h["score"] for out in got["outputs"] for h in out["hypotheses"]]
        assert served == pytest.approx(with_tuned, abs=1e-4)
    finally:
        server.stop()


def test_a_broken_decoding_json_is_named_in_one_line(run: Path, nmt_cli: NmtCli) -> None:
    for content in ("{not json", json.dumps({"format": "other"}),
                    json.dumps({"format": "nmt-decoding-v1", "settings": {"alpha": "x"}}),
                    json.dumps({"format": "nmt-decoding-v1", "settings": {"beam": 2.5}})):
        (run / "decoding.json").write_text(content, encoding="utf-8")
        result = nmt_cli.run("translate", "-m", run / "average.pt", *SHORT_FLAGS,
                             input="A dog.\n")
        assert_one_line(result, 3, "decoding.json", "nmt tune")
