"""`nmt export hf`: the exported MarianMTModel is the same model, proven on a small model
trained on Multi30k: teacher-forced log-probabilities equal nmt's within 1e-4, the
tokenizer's ids equal nmt's (all of test2016 and hostile lines), greedy and beam-4 output
identical on >= 99 % of the lines; pre-norm and other inexpressible models are refused."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from helpers.checkpoints import make_checkpoint, make_vocab
from helpers.cli import NmtCli, assert_one_line

from nmt.checkpoint import load_model
from nmt.config import DecodeConfig
from nmt.data.vocab import BOS_ID, EOS_ID

transformers = pytest.importorskip("transformers",
                                   reason="needs the hf extra: pip install '.[hf]'")
pytestmark = pytest.mark.usefixtures("one_thread")
HOSTILE = ["", "   ", "日本語のテキスト ☃ \u200b", "</s> <pad> <unk> <s>", "x" * 3000,
           "\u00e9\u0301 ﬁ \x7f", "\t tab\u00a0nbsp", "🙂" * 40]


@pytest.fixture(scope="module")
def exported(multi30k_model: Path, tmp_path_factory: pytest.TempPathFactory,
             nmt_cli: NmtCli) -> Path:
    out = tmp_path_factory.mktemp("hf") / "model"
    result = nmt_cli.run("export", "hf", "-m", multi30k_model, "-o", out)
    assert result.returncode == 0, result.err
    return out


@pytest.fixture(scope="module")
def test2016() -> tuple[list[str], list[str]]:
    from conftest import shared_data_path

    def read(lang: str) -> list[str]:
        path = shared_data_path("multi30k", f"test_2016_flickr.{lang}")
        return path.read_text(encoding="utf-8").split("\n")[:1000]

    return read("en"), read("de")


def test_directory_loads_with_no_code_of_ours(exported: Path) -> None:
    names = {p.name for p in exported.iterdir()}
    assert {"config.json", "generation_config.json", "model.safetensors", "source.spm",
            "target.spm", "vocab.json", "tokenizer_config.json", "README.md"} <= names
    model = transformers.AutoModelForSeq2SeqLM.from_pretrained(exported)
    assert type(model).__name__ == "MarianMTModel"
    tokenizer = transformers.AutoTokenizer.from_pretrained(exported)
    assert type(tokenizer).__name__ == "MarianTokenizer"
    card = (exported / "README.md").read_text(encoding="utf-8")
    assert "600 updates" in card and "length ** alpha" in card


def test_tokenizer_ids_equal_nmts(exported: Path, multi30k_model: Path,
                                  test2016: tuple[list[str], list[str]]) -> None:
    _, vocab, _ = load_model(multi30k_model)
    tokenizer = transformers.AutoTokenizer.from_pretrained(exported)
    lines = test2016[0] + HOSTILE
    ours = [ids + [EOS_ID] for ids in vocab.encode(lines)]
    theirs = [tokenizer(line)["input_ids"] for line in lines]
    assert theirs == ours


@torch.no_grad()
def test_teacher_forced_log_probs_equal(exported: Path, multi30k_model: Path,
                                        test2016: tuple[list[str], list[str]]) -> None:
    """In float64 the two compute the same function (measured: 1.4e-13 apart); in float32
    each rounds its own way (measured on this model, against float64: nmt 5.2e-5,
    transformers 1.3e-4; 1.8e-4 apart on an Intel Xeon, 5.3e-4 on an AMD EPYC Zen 5, whose
    kernels round differently), so float32 gets a rounding-sized bound."""
    model, vocab, _ = load_model(multi30k_model)
    hf = transformers.AutoModelForSeq2SeqLM.from_pretrained(exported).eval()
    for dtype, bound in ((torch.float64, 1e-9), (torch.float32, 1e-3)):
        model, hf = model.to(dtype), hf.to(dtype)
        worst = 0.0
        for source, target in zip(*[side[:100] for side in test2016], strict=True):
            src = torch.tensor([vocab.encode([source])[0] + [EOS_ID]])
            tgt = vocab.encode([target])[0]
            tgt_in, gold = torch.tensor([[BOS_ID, *tgt]]), torch.tensor([[*tgt, EOS_ID]])
            ours = torch.log_softmax(model(src, tgt_in).to(dtype), -1).gather(
                2, gold[..., None])
            logits = hf(input_ids=src, decoder_input_ids=tgt_in).logits
            theirs = torch.log_softmax(logits, -1).gather(2, gold[..., None])
            worst = max(worst, float((ours - theirs).abs().max()))
        assert worst < bound, (dtype, worst)


@pytest.mark.parametrize("beam", [1, 4])
def test_search_output_identical(exported: Path, multi30k_model: Path, beam: int,
                                 test2016: tuple[list[str], list[str]]) -> None:
    """Greedy, and beam 4 at length penalty 0, over 300 lines: identical on >= 99 % of
    those that end before the length limit (both stop at 40 pieces here)."""
    from nmt.inference.translate import Engine, translate_texts

    sources = test2016[0][:300]
    limit = 40
    translator = Engine.load([multi30k_model], DecodeConfig(
        beam=beam, alpha=0.0, max_len_a=0.0, max_len_b=limit), device="cpu",
        precision="fp32")
    ours = [r.hypotheses[0].tokens for r in translate_texts(translator, sources)]
    tokenizer = transformers.AutoTokenizer.from_pretrained(exported)
    hf = transformers.AutoModelForSeq2SeqLM.from_pretrained(exported).eval()
    theirs = []
    with torch.no_grad():
        for start in range(0, len(sources), 50):
            batch = tokenizer(sources[start:start + 50], return_tensors="pt", padding=True)
            out = hf.generate(**batch, num_beams=beam, do_sample=False, length_penalty=0.0,
                              max_new_tokens=limit + 1, early_stopping=True)
            for row in out.tolist():
                ids = row[1:]  # after the start token
                theirs.append(ids[:ids.index(EOS_ID)] if EOS_ID in ids else ids)
    ended = [i for i, ids in enumerate(ours) if len(ids) < limit]
    same = sum(ours[i] == theirs[i] for i in ended)
    assert len(ended) > 250 and same >= 0.99 * len(ended), (same, len(ended))


def test_pipeline_translates(exported: Path, multi30k_model: Path,
                             test2016: tuple[list[str], list[str]]) -> None:
    """pipeline("translation") (transformers 4.x; 5.x removed the task) gives what the
    model's own generate() gives, with the exported generation config."""
    if "translation" in getattr(transformers.pipelines, "REMOVED_TASKS", {}):
        pytest.skip(f"transformers {transformers.__version__} removed the translation "
                    "pipeline (the dev extra pins transformers < 5, which has it)")
    translate = transformers.pipeline("translation", model=str(exported), device="cpu")
    sources = test2016[0][:5]
    got = [r["translation_text"] for r in translate(sources)]
    tokenizer = transformers.AutoTokenizer.from_pretrained(exported)
    hf = transformers.AutoModelForSeq2SeqLM.from_pretrained(exported).eval()
    with torch.no_grad():
        out = hf.generate(**tokenizer(sources, return_tensors="pt", padding=True))
    assert got == tokenizer.batch_decode(out, skip_special_tokens=True)
    assert all(got)


def test_inexpressible_models_are_refused(tmp_path: Path, nmt_cli: NmtCli) -> None:
    from conftest import shared_data_path

    spm = make_vocab(shared_data_path("multi30k"), tmp_path / "spm", lines=300, size=500)
    for name, overrides, words in (
            ("pre", {"pre_norm": True}, "it is pre-norm"),
            ("learned", {"learned_positions": True}, "learned positions"),
            ("heads", {"d_k": 8}, "heads are 8/")):
        checkpoint = make_checkpoint(spm, tmp_path / f"{name}.pt", **overrides)
        result = nmt_cli.invoke("export", "hf", "-m", checkpoint, "-o", tmp_path / name)
        assert_one_line(result, 2, "cannot export as a transformers MarianMTModel", words,
                        "nmt export ct2 takes it")
        assert not (tmp_path / name).exists()
