"""`nmt score` on the real newstest2014 files, checked against sacreBLEU's own API."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import sacrebleu
from helpers.cli import NmtCli

from nmt.score import paper_tokenize


def perturb(lines: list[str]) -> list[str]:
    """Drop the last word of every third line and swap the first two of every fifth."""
    out = []
    for i, line in enumerate(lines):
        words = line.split()
        if i % 3 == 0 and len(words) > 1:
            words = words[:-1]
        if i % 5 == 0 and len(words) > 2:
            words[0], words[1] = words[1], words[0]
        out.append(" ".join(words))
    return out


def test_reference_against_itself_is_100(wmt14_dir: Path, tmp_path: Path, nmt_cli: NmtCli) -> None:
    ref = wmt14_dir / "newstest2014.de"
    result = nmt_cli.invoke("score", "--ref", str(ref), "-i", str(ref), "--json")
    assert result.returncode == 0, result.output
    record = json.loads(result.out.strip())
    assert record["scores"][0]["score"] == pytest.approx(100.0)
    assert "tok:13a" in record["scores"][0]["signature"]
    # chrF and TER (slow on 3,003 lines) on the first 300.
    head = tmp_path / "head.de"
    head.write_bytes(b"".join(ref.read_bytes().splitlines(keepends=True)[:300]))
    result = nmt_cli.invoke("score", "--ref", str(head), "-i", str(head), "--json", "--metrics",
                            "chrf,ter")
    by_metric = {s["metric"]: s["score"] for s in json.loads(result.out)["scores"]}
    assert by_metric == {"chrf": pytest.approx(100.0), "ter": pytest.approx(0.0)}
    # The spelling: space-separated names after one --metrics.
    spaced = nmt_cli.invoke("score", "--ref", str(head), "-i", str(head), "--json", "--metrics",
                            "bleu", "chrf", "ter")
    assert [s["metric"] for s in json.loads(spaced.out)["scores"]] == ["bleu", "chrf", "ter"]


def test_perturbation_matches_sacrebleu_api(wmt14_dir: Path, tmp_path: Path,
                                            nmt_cli: NmtCli) -> None:
    ref = wmt14_dir / "newstest2014.de"
    refs = ref.read_text(encoding="utf-8").split("\n")[:-1]
    hyps = perturb(refs)
    hyp = tmp_path / "hyp.de"
    hyp.write_text("\n".join(hyps) + "\n", encoding="utf-8")
    expected = sacrebleu.corpus_bleu(hyps, [refs]).score
    expected_chrf = sacrebleu.corpus_chrf(hyps, [refs]).score
    result = nmt_cli.invoke("score", "--ref", str(ref), "-i", str(hyp), "--json", "-M", "bleu",
                            "-M", "chrf")
    assert result.returncode == 0, result.output
    scores = json.loads(result.out)["scores"]
    assert 50 < scores[0]["score"] < 100
    assert scores[0]["score"] == pytest.approx(expected, abs=1e-9)
    assert scores[1]["score"] == pytest.approx(expected_chrf, abs=1e-9)
    # Human output: the score line and sacreBLEU's signature; stdin works the same.
    human = nmt_cli.invoke("score", "--ref", str(ref), input=hyp.read_bytes())
    assert human.returncode == 0, human.output
    assert human.out.startswith(f"BLEU = {expected:.2f}")
    assert "signature: nrefs:1|case:mixed|eff:no|tok:13a" in human.out
    intl = nmt_cli.invoke("score", "--ref", str(ref), "-i", str(hyp), "--tokenize", "intl",
                          "--json")
    assert json.loads(intl.out)["scores"][0]["score"] == pytest.approx(
        sacrebleu.corpus_bleu(hyps, [refs], tokenize="intl").score)


def test_paper_bleu_splits_compounds_in_both_sides(tmp_path: Path, nmt_cli: NmtCli) -> None:
    assert paper_tokenize(["Ein Mehrzweck-Gerät für a-b-c & mehr."], "de") == [
        "Ein Mehrzweck ##AT##-##AT## Gerät für a ##AT##-##AT## b-c &amp; mehr ."]
    ref = tmp_path / "ref.de"
    hyp = tmp_path / "hyp.de"
    ref.write_text("Das Mehrzweck-Gerät ist gut.\n", encoding="utf-8")
    hyp.write_text("Das Mehrzweck-Gerät ist schlecht.\n", encoding="utf-8")
    # Tokens: Das Mehrzweck ##AT##-##AT## Gerät ist gut/schlecht . -> 7 tokens, 6 match.
    result = nmt_cli.invoke("score", "--ref", str(ref), "-i", str(hyp), "--paper", "--json")
    assert result.returncode == 0, result.output
    score = json.loads(result.out)["scores"][0]
    assert score["metric"] == "bleu-paper" and "moses-de" in score["signature"]
    # By hand: 1-grams 6/7; 2-grams 4/6; 3-grams 3/5 (Das M AT, M AT G, AT G ist);
    # 4-grams 2/4 (Das M AT G, M AT G ist); equal lengths so BP = 1.
    hand = 100 * (6 / 7 * 4 / 6 * 3 / 5 * 2 / 4) ** 0.25
    assert score["score"] == pytest.approx(hand, abs=1e-6)
    human = nmt_cli.invoke("score", "--ref", str(ref), "-i", str(hyp), "--paper")
    assert human.out.startswith("paper-style tokenized BLEU")


def test_line_count_mismatch_names_counts_and_files(tmp_path: Path, nmt_cli: NmtCli) -> None:
    ref = tmp_path / "ref.de"
    hyp = tmp_path / "hyp.de"
    ref.write_text("a\nb\nc\n", encoding="utf-8")
    hyp.write_text("a\nb\n", encoding="utf-8")
    result = nmt_cli.invoke("score", "--ref", str(ref), "-i", str(hyp))
    assert result.returncode == 3
    assert "2 hypotheses in" in result.err and "3 references in" in result.err
    assert str(hyp) in result.err and str(ref) in result.err
    assert len(result.err.strip().splitlines()) == 1


def test_empty_and_non_utf8_files_are_clear_errors(tmp_path: Path, nmt_cli: NmtCli) -> None:
    ref = tmp_path / "ref.de"
    ref.write_text("a\nb\n", encoding="utf-8")
    empty = tmp_path / "empty.de"
    empty.write_bytes(b"")
    result = nmt_cli.invoke("score", "--ref", str(ref), "-i", str(empty))
    assert result.returncode == 3 and "is empty" in result.err
    bad = tmp_path / "bad.de"
    bad.write_bytes(b"ok\n\xff\xfe oops\n")
    result = nmt_cli.invoke("score", "--ref", str(ref), "-i", str(bad))
    assert result.returncode == 3 and "line 2: invalid UTF-8" in result.err
    result = nmt_cli.invoke("score", "--ref", str(tmp_path / "missing.de"), "-i", str(ref))
    assert result.returncode == 3 and "cannot read" in result.err
    result = nmt_cli.invoke("score", "--ref", str(ref), "-i", str(ref), "--metrics", "meteor")
    assert result.returncode == 2 and "unknown metric" in result.err
    result = nmt_cli.invoke("score", "--ref", str(ref), "-i", str(ref), "--metrics", "bleu",
                            "stray")
    assert result.returncode == 2 and "unknown metric" in result.err


def test_corpus_scores_is_sacrebleus_corpus_bleu_and_chrf(multi30k_dir) -> None:
    """The one scoring path of validation and the benches equals sacreBLEU's own corpus
    functions (13a BLEU, chrF), and scores against the first len(hyps) references."""
    from nmt.score import corpus_scores

    refs = (multi30k_dir / "test_2016_flickr.de").read_text(encoding="utf-8").splitlines()
    hyps = [" ".join(line.split()[::-1][:8]) for line in refs[:300]]  # a poor system
    got = corpus_scores(hyps, refs, ("bleu", "chrf"))
    assert got == {"bleu": sacrebleu.corpus_bleu(hyps, [refs[:300]]).score,
                   "chrf": sacrebleu.corpus_chrf(hyps, [refs[:300]]).score}
    assert corpus_scores(hyps, refs, digits=2)["bleu"] == round(got["bleu"], 2)
    assert corpus_scores(refs[:50], refs)["bleu"] == pytest.approx(100.0)


def _prepared(root: Path, wmt14_dir: Path, lines: int = 100) -> Path:
    """A DATA folder as `nmt prep` leaves it: test.src/test.tgt beside manifest.json."""
    data = root / "data"
    data.mkdir()
    for side, lang in (("src", "en"), ("tgt", "de")):
        text = (wmt14_dir / f"newstest2014.{lang}").read_text(encoding="utf-8")
        (data / f"test.{side}").write_text("".join(text.splitlines(True)[:lines]), "utf-8")
    (data / "manifest.json").write_text(json.dumps({"recipe": "wmt14-en-de", "src_lang": "en",
                                                    "tgt_lang": "de"}), encoding="utf-8")
    return data


def test_paper_bleu_takes_the_language_of_the_prepared_data(wmt14_dir: Path, tmp_path: Path,
                                                            nmt_cli: NmtCli) -> None:
    data = _prepared(tmp_path, wmt14_dir)
    hyp = tmp_path / "out.txt"  # hypotheses' names never choose the language
    hyp.write_text("\n".join(perturb((data / "test.tgt").read_text("utf-8").splitlines()))
                   + "\n", encoding="utf-8")
    named_de = tmp_path / "ref.de"
    named_de.write_bytes((data / "test.tgt").read_bytes())
    scores = {}
    for ref in (data / "test.tgt", named_de):
        result = nmt_cli.invoke("score", "--paper", "--json", "--ref", str(ref), "-i", str(hyp))
        assert result.returncode == 0, result.output
        score = json.loads(result.out)["scores"][0]
        assert "moses-de+" in score["signature"]
        scores[ref.name] = score["score"]
    assert scores["test.tgt"] == scores["ref.de"] < 100
    # The source side of prepared data is English: a De->En hypothesis scored against it.
    result = nmt_cli.invoke("score", "--paper", "--json", "--ref", str(data / "test.src"),
                            "-i", str(data / "test.src"))
    assert "moses-en+" in json.loads(result.out)["scores"][0]["signature"]


@pytest.mark.parametrize("name", ["test.tgt", "hyp.txt", "newstest2014"])
def test_paper_bleu_refuses_a_name_that_is_not_a_language(name: str, wmt14_dir: Path,
                                                          tmp_path: Path,
                                                          nmt_cli: NmtCli) -> None:
    ref = tmp_path / name  # outside any prepared data: no manifest.json beside it
    ref.write_text("Das ist gut.\n", encoding="utf-8")
    result = nmt_cli.invoke("score", "--paper", "--ref", str(ref), "-i", str(ref))
    assert result.returncode == 2, result.output
    assert len(result.err.strip().splitlines()) == 1 and "--lang" in result.err
    assert str(ref) in result.err and "Traceback" not in result.err
    given = nmt_cli.invoke("score", "--paper", "--json", "--lang", "de", "--ref", str(ref),
                           "-i", str(ref))
    assert given.returncode == 0 and "moses-de+" in given.out


def test_paper_bleu_names_a_manifest_without_the_language(wmt14_dir: Path, tmp_path: Path,
                                                          nmt_cli: NmtCli) -> None:
    data = _prepared(tmp_path, wmt14_dir, lines=3)
    (data / "manifest.json").write_text('{"recipe": "x"}', encoding="utf-8")
    result = nmt_cli.invoke("score", "--paper", "--ref", str(data / "test.tgt"), "-i",
                            str(data / "test.tgt"))
    assert result.returncode == 3 and "manifest.json" in result.err and "--lang" in result.err
