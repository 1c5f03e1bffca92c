"""The Python API (nmt/api.py): `from nmt import Translator` without torch, run-directory
resolution, output identical to `nmt translate`, n-best with scores, target prefixes (also
`nmt translate --prefix-file`), forced-decoding scores, bad input, several threads."""

from __future__ import annotations

import shutil
import threading
from pathlib import Path

import pytest
from helpers.cli import NmtCli, assert_one_line

from nmt.errors import DataError, UsageError

pytestmark = pytest.mark.usefixtures("one_thread")
SHORT = {"max_len_a": 0.0, "max_len_b": 10}  # random-init models talk to the length limit
SHORT_FLAGS = ("--max-len-a", "0", "--max-len-b", "10", "--precision", "fp32")


@pytest.fixture(scope="module")
def ckpt(tiny_checkpoint: Path) -> Path:
    return tiny_checkpoint


@pytest.fixture(scope="module")
def lines() -> list[str]:
    """100 test2016 lines with an empty and a whitespace-only one among them."""
    from conftest import shared_data_path

    text = shared_data_path("multi30k", "test_2016_flickr.en").read_text(encoding="utf-8")
    head = text.split("\n")[:98]
    return [*head[:40], "", *head[40:70], "   ", *head[70:]]


@pytest.fixture(scope="module")
def translator(ckpt: Path):  # an nmt.api.Translator
    from nmt import Translator

    return Translator.load(ckpt, precision="fp32", quiet=True)


def test_importing_the_api_does_not_import_torch(nmt_cli: NmtCli) -> None:
    import subprocess
    import sys

    code = ("import sys; from nmt import Translator, TranslationResult; "
            "assert 'torch' not in sys.modules, 'torch imported'; print(Translator.__name__)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env=nmt_cli.env(), check=False)
    assert done.returncode == 0 and done.stdout.strip() == "Translator", done.stderr


@pytest.mark.slow
def test_translate_equals_the_cli_byte_for_byte(translator, ckpt: Path, lines: list[str],
                                                nmt_cli: NmtCli) -> None:
    got = translator.translate(lines, **SHORT)
    assert isinstance(got, list) and len(got) == len(lines)
    assert got[40] == "" and got[71] == ""  # empty and whitespace-only lines stay empty
    result = nmt_cli.run("translate", "-m", ckpt, *SHORT_FLAGS, input="\n".join(lines) + "\n")
    assert result.returncode == 0, result.err
    assert result.stdout == ("\n".join(got) + "\n").encode("utf-8")

    best = translator.translate_hypotheses(lines[:20], nbest=3, beam=4, **SHORT)
    cli = nmt_cli.run("translate", "-m", ckpt, *SHORT_FLAGS, "--nbest", "3",
                      input="\n".join(lines[:20]) + "\n")
    expected = "".join(f"{i}\t{h.score:.4f}\t{h.text}\n" for i, r in enumerate(best)
                       for h in r.hypotheses)
    assert cli.out == expected


def test_nbest_and_scores_are_typed_results(translator, lines: list[str]) -> None:
    """One return type per call: strings from translate, results from
    translate_hypotheses."""
    results = translator.translate_hypotheses(lines[:5] + [""], nbest=2, **SHORT)
    assert len(results) == 6 and results[-1].hypotheses == [] and results[-1].text == ""
    for result in results[:5]:
        assert len(result.hypotheses) == 2 and result.text == result.hypotheses[0].text
        assert result.hypotheses[0].score >= result.hypotheses[1].score
        assert all(h.log_prob < 0 for h in result.hypotheses)
    one = translator.translate_hypotheses(lines[:3], **SHORT)
    assert [len(r.hypotheses) for r in one] == [1, 1, 1]
    assert [r.text for r in one] == translator.translate(lines[:3], **SHORT)


def test_score_equals_the_searchs_log_probability(translator, lines: list[str]) -> None:
    """Forced decoding of the pieces a search found gives the log-probability it reported;
    the API scores text, re-tokenized, so it agrees wherever the pieces round-trip."""
    from nmt.config import DecodeConfig
    from nmt.inference.scoring import score_ids

    engine = translator._engine
    sources = [line for line in lines[:30] if line.strip()]
    src_ids = engine.vocab.encode(sources)
    saved, engine.decode_cfg = engine.decode_cfg, DecodeConfig(**SHORT)
    try:
        hyps = [h[0] for h in engine.translate_ids(src_ids)]
    finally:
        engine.decode_cfg = saved
    scored = score_ids(engine, src_ids, [h.tokens for h in hyps], max_tokens=512)
    for hyp, (log_prob, tokens) in zip(hyps, scored, strict=True):
        assert log_prob == pytest.approx(hyp.log_prob, abs=2e-3)
        assert tokens == len(hyp.tokens) + 1
    from conftest import shared_data_path

    refs = shared_data_path("multi30k", "test_2016_flickr.de").read_text(
        encoding="utf-8").split("\n")[:len(sources)]  # real German: text scored as its pieces
    scores = translator.score(sources, refs, max_tokens=512)  # same batches: same floats
    expected = score_ids(engine, src_ids, engine.vocab.encode(refs), max_tokens=512)
    assert [(s.log_prob, s.tokens) for s in scores] == expected
    for score in scores:
        assert score.normalized == pytest.approx(score.log_prob / score.tokens)
    empty = translator.score([sources[0]], [""])[0]
    assert empty.tokens == 1 and empty.log_prob < 0  # EOS alone
    with pytest.raises(UsageError, match="2 sources but 1 targets"):
        translator.score(sources[:2], [""])


def test_target_prefix_starts_the_output(translator, ckpt: Path, lines: list[str],
                                         nmt_cli: NmtCli, tmp_path: Path) -> None:
    sources = lines[:6]
    prefixes = ["Ein Mann", None, "Zwei Hunde spielen", "", "Eine Frau", None]
    got = translator.translate(sources, target_prefix=prefixes, **SHORT)
    free = translator.translate(sources, **SHORT)
    for text, prefix, plain in zip(got, prefixes, free, strict=True):
        if prefix:
            assert text.startswith(prefix), (prefix, text)
        else:
            assert text == plain  # no prefix: as without the option
    greedy = translator.translate(sources, target_prefix=prefixes, beam=1, **SHORT)
    assert all(t.startswith(p) for t, p in zip(greedy, prefixes, strict=True) if p)

    prefix_file = tmp_path / "prefixes.txt"
    prefix_file.write_text("\n".join(p or "" for p in prefixes) + "\n", encoding="utf-8")
    cli = nmt_cli.run("translate", "-m", ckpt, *SHORT_FLAGS, "--prefix-file", prefix_file,
                      input="\n".join(sources) + "\n")
    assert cli.returncode == 0 and cli.out == "\n".join(got) + "\n", cli.err
    prefix_file.write_text("Ein Mann\n", encoding="utf-8")
    short = nmt_cli.run("translate", "-m", ckpt, *SHORT_FLAGS, "--prefix-file", prefix_file,
                        input="\n".join(sources) + "\n")
    assert_one_line(short, 3, str(prefix_file), "has 1 lines, fewer than")
    with pytest.raises(UsageError, match="target_prefix has 1 entries for 6 lines"):
        translator.translate(sources, target_prefix=["x"])


def test_run_directory_means_average_then_best_then_last(ckpt: Path, tmp_path: Path,
                                                         nmt_cli: NmtCli,
                                                         capsys: pytest.CaptureFixture
                                                         ) -> None:
    from nmt import Translator
    from nmt.checkpoint import resolve_model_path

    run = tmp_path / "run"
    run.mkdir()
    with pytest.raises(DataError, match="a directory with no model in it"):
        resolve_model_path(run)
    for name, expected in (("checkpoint_last.pt", "checkpoint_last.pt"),
                           ("checkpoint_best.pt", "checkpoint_best.pt"),
                           ("average.pt", "average.pt")):
        shutil.copy(ckpt, run / name)
        assert resolve_model_path(run) == (run / expected, True)
    assert resolve_model_path(ckpt) == (ckpt, False)
    Translator.load(run, precision="fp32")
    assert f"{run}: using {run / 'average.pt'}" in capsys.readouterr().err
    result = nmt_cli.run("translate", "-m", run, *SHORT_FLAGS, input="A dog.\n")
    assert result.returncode == 0 and len(result.out.splitlines()) == 1, result.err
    assert f"-m {run}: using {run / 'average.pt'}" in result.err
    empty = tmp_path / "empty"
    empty.mkdir()
    missing = nmt_cli.run("translate", "-m", empty, input="A dog.\n")
    assert_one_line(missing, 3, str(empty), "average.pt, checkpoint_best.pt")


def test_bad_arguments_are_usage_errors(translator) -> None:
    with pytest.raises(UsageError, match="must be a list of strings"):
        translator.translate("A man.")
    with pytest.raises(UsageError, match=r"lines\[1\] is int"):
        translator.translate(["A man.", 3])
    with pytest.raises(UsageError, match="exceeds --beam"):
        translator.translate_hypotheses(["A man."], nbest=5)
    with pytest.raises(UsageError, match="use translate_hypotheses"):
        translator.translate(["A man."], nbest=2)
    with pytest.raises(UsageError, match="unknown option.s. colour; the options are beam, "):
        translator.translate(["A man."], colour=2)
    with pytest.raises(UsageError, match="max_src_len must be in 1.."):
        translator.translate(["A man."], max_src_len=0)


@pytest.mark.parametrize("precision", ["fp32", "int8"])
def test_parameters_are_the_models_whatever_its_linears_became(ckpt: Path,
                                                               precision: str) -> None:
    """Packed (fp32) or quantized (int8) linears hold no parameters: the count is the
    checkpoint's model's, taken before."""
    from nmt import Translator
    from nmt.checkpoint import load_model

    model = load_model(ckpt, "cpu", "auto")[0]
    want = sum(p.numel() for p in model.parameters())
    assert Translator.load(ckpt, precision=precision, quiet=True).parameters == want


def test_a_lone_surrogate_reads_as_u_fffd(translator) -> None:
    """A str may hold a lone surrogate that no UTF-8 can (sentencepiece raised a raw
    TypeError): translate, score, prefixes and counting read it as U+FFFD."""
    odd, fixed = ["A dog \ud800 runs.", "\udfff"], ["A dog \ufffd runs.", "\ufffd"]
    assert translator.translate(odd, **SHORT) == translator.translate(fixed, **SHORT)
    assert translator.translate(odd, target_prefix=["\ud800", None], **SHORT) == \
        translator.translate(fixed, target_prefix=["\ufffd", None], **SHORT)
    assert translator.score(odd, odd) == translator.score(fixed, fixed)
    assert translator.count_tokens(odd) == translator.count_tokens(fixed)


def test_one_translator_shared_by_threads(translator, lines: list[str]) -> None:
    """Calls from several threads at once give what each gives alone, in order."""
    chunks = [lines[i:i + 7] for i in range(0, 56, 7)]
    alone = [translator.translate(chunk, **SHORT) for chunk in chunks]
    got: dict[int, list[str]] = {}
    errors: list[BaseException] = []

    def work(i: int) -> None:
        try:
            got[i] = translator.translate(chunks[i], **SHORT)
        except BaseException as err:  # reported below
            errors.append(err)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(len(chunks))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors and [got[i] for i in range(len(chunks))] == alone


@pytest.mark.parametrize("nbest", [1, 3])
def test_every_cache_reorder_of_a_translation_carries_its_layout(
        translator, lines: list[str], monkeypatch: pytest.MonkeyPatch, nbest: int) -> None:
    """Beam search and sampling tell the cache the layout of each reorder (`regroup`), so
    GroupedCache never reads the order back to find it (two host syncs on a GPU)."""
    from nmt.inference.kv_cache import GroupedCache

    real = GroupedCache.reorder
    layouts: list[object] = []

    def reorder(self, new_order, layout=None):
        layouts.append(layout)
        return real(self, new_order, layout)

    monkeypatch.setattr(GroupedCache, "reorder", reorder)
    translator.translate_hypotheses(lines[:6], sampling=True, seed=3, nbest=nbest, **SHORT)
    translator.translate_hypotheses(lines[:6], nbest=nbest, **SHORT)
    assert layouts and all(layout is not None for layout in layouts), layouts


def test_sampling_seed_makes_a_call_reproducible(translator, lines: list[str]) -> None:
    first = translator.translate(lines[:5], sampling=True, seed=3, **SHORT)
    assert translator.translate(lines[:5], sampling=True, seed=3, **SHORT) == first
