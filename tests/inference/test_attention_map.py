"""`nmt translate --attention`: attention maps by teacher forcing, checked against an
explicit softmax over the full (non-incremental) decoder, and the PNGs the CLI writes."""

from __future__ import annotations

import struct
from pathlib import Path

import pytest
import torch
from helpers.checkpoints import make_checkpoint, make_vocab
from helpers.cli import NmtCli

from nmt.checkpoint import load_model
from nmt.config import DecodeConfig
from nmt.data.vocab import BOS_ID, EOS_ID, PAD_ID
from nmt.errors import UsageError
from nmt.inference.attention_map import attention_maps, piece_labels, resolve_layer
from nmt.inference.translate import Engine
from nmt.plot import plot_attention

pytestmark = pytest.mark.usefixtures("one_thread")

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
FAST = ("--beam", "2", "--max-len-b", "6")
CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def spm(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from conftest import shared_data_path

    return make_vocab(shared_data_path("multi30k"), tmp_path_factory.mktemp("attn_vocab"))


@pytest.fixture(scope="module")
def ckpt(spm: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_checkpoint(spm, tmp_path_factory.mktemp("attn") / "model.pt")


@pytest.fixture(scope="module")
def test_lines() -> list[str]:
    from conftest import shared_data_path

    text = shared_data_path("multi30k", "test_2016_flickr.en").read_text(encoding="utf-8")
    return text.split("\n")[:6]


def translated(ckpt: Path, lines: list[str]) -> tuple[Engine, list[list[int]],
                                                        list[list[int]]]:
    """Source ids and best hypotheses (ids without EOS) of real test lines, beam 2."""
    translator = Engine.load([ckpt], DecodeConfig(beam=2, max_len_b=6), device="cpu",
                                 precision="fp32")
    sources = translator.vocab.encode(lines)
    hyps = [h[0].tokens for h in translator.translate_ids(sources)]
    return translator, sources, hyps


def reference_cross_attention(model: torch.nn.Module, sources: list[list[int]],
                              hyps: list[list[int]], layer: int) -> torch.Tensor:
    """Encoder-decoder attention of `layer` from ONE full teacher-forced decoder pass over a
    padded batch, recomputed from the layer's weights with an explicit masked softmax.

    A pre-hook records the query input of the layer's cross-attention; Q and K are then
    projected with the raw q / kv weight matrices. Returns (batch, heads, T, S).
    """
    src_len = max(len(s) for s in sources) + 1
    tgt_len = max(len(h) for h in hyps) + 1
    src = torch.full((len(sources), src_len), PAD_ID, dtype=torch.long)
    tgt_in = torch.full((len(hyps), tgt_len), PAD_ID, dtype=torch.long)
    for row, (s, h) in enumerate(zip(sources, hyps, strict=True)):
        src[row, :len(s) + 1] = torch.tensor([*s, EOS_ID])
        tgt_in[row, :len(h) + 1] = torch.tensor([BOS_ID, *h])
    cross = model.decoder[layer].cross_attn
    seen: list[torch.Tensor] = []
    handle = cross.register_forward_pre_hook(lambda _m, args: seen.append(args[0]))
    try:
        with torch.no_grad():
            enc = model.encode(src)
            model.decode(tgt_in, enc)  # the full, non-incremental decoder
    finally:
        handle.remove()
    (query_in,) = seen  # (batch, T, d_model), called once for the whole sequence
    heads, d_k = cross.heads, cross.d_k
    with torch.no_grad():
        q = query_in @ cross.q.weight.T + cross.q.bias  # (batch, T, heads*d_k)
        q = q.view(len(hyps), tgt_len, heads, d_k).transpose(1, 2)  # (batch, heads, T, d_k)
        w_k, b_k = cross.kv.weight[:heads * d_k], cross.kv.bias[:heads * d_k]
        k = enc.states @ w_k.T + b_k  # (batch, S, heads*d_k)
        k = k.view(len(sources), src_len, heads, d_k).transpose(1, 2)  # (batch, heads, S, d_k)
        scores = q @ k.transpose(-1, -2) / d_k ** 0.5  # (batch, heads, T, S)
        scores = scores.masked_fill(src.eq(PAD_ID)[:, None, None, :], float("-inf"))
        return scores.softmax(dim=-1)


@pytest.mark.parametrize("layer", [0, -1])
def test_maps_equal_full_decoder_softmax(ckpt: Path, test_lines: list[str],
                                         layer: int) -> None:
    translator, sources, hyps = translated(ckpt, test_lines)
    model = translator.models[0]  # as `nmt translate` runs it (linears packed on a CPU)
    plain, _, _ = load_model(ckpt, CPU)  # raw weight matrices for the reference
    reference = reference_cross_attention(plain, sources, hyps, layer)
    assert len({len(s) for s in sources}) > 1  # the batch really is padded
    for row, (src_ids, hyp_ids) in enumerate(zip(sources, hyps, strict=True)):
        weights, src_labels, tgt_labels = attention_maps(model, translator.vocab, src_ids,
                                                         hyp_ids, layer, CPU)
        heads = model.config.heads
        assert weights.shape == (heads, len(hyp_ids) + 1, len(src_ids) + 1)
        assert weights.dtype == torch.float32
        assert (len(tgt_labels), len(src_labels)) == weights.shape[1:]
        # every row is a distribution over the real source positions (pieces + EOS)
        torch.testing.assert_close(weights.sum(-1), torch.ones(weights.shape[:2]))
        assert bool((weights >= 0).all())
        t, s = weights.shape[1:]
        torch.testing.assert_close(weights, reference[row, :, :t, :s], atol=1e-5, rtol=1e-4)
        assert not bool(reference[row, :, :t, s:].any())  # padding gets no attention


def test_labels_and_layer_range(ckpt: Path) -> None:
    model, vocab, _ = load_model(ckpt, CPU)
    ids = vocab.encode(["A dog runs."])[0]
    labels = piece_labels(vocab, ids)
    assert labels[-1] == "</s>" and "".join(labels[:-1]).replace("▁", " ").strip() \
        == "A dog runs."
    layers = len(model.decoder)
    assert [resolve_layer(model, i) for i in (-layers, -1, 0, layers - 1)] == \
        [0, layers - 1, 0, layers - 1]
    for bad in (layers, -layers - 1):
        with pytest.raises(UsageError, match=rf"0\.\.{layers - 1}"):
            attention_maps(model, vocab, ids, ids, bad, CPU)


def test_plot_rejects_mismatched_labels() -> None:
    with pytest.raises(ValueError, match="do not match"):
        plot_attention(torch.rand(2, 3, 4).numpy(), ["a"] * 3, ["b"] * 3)


def png_size(path: Path) -> tuple[int, int]:
    """(width, height) from a PNG's IHDR chunk."""
    head = path.read_bytes()[:24]
    assert head[:8] == PNG_MAGIC
    return struct.unpack(">II", head[16:24])


def test_cli_writes_one_png_per_line_and_same_output(ckpt: Path, test_lines: list[str],
                                                     tmp_path: Path, nmt_cli: NmtCli) -> None:
    # lines 2 and 5 are empty, 4 is whitespace only: no PNG for them
    lines = [test_lines[0], "", test_lines[1], "   ", "", test_lines[2]]
    source = tmp_path / "in.en"
    source.write_text("\n".join(lines) + "\n", encoding="utf-8")
    plain = nmt_cli.invoke("translate", "-m", str(ckpt), "-i", str(source), *FAST)
    assert plain.returncode == 0, plain.stderr.decode()
    maps = tmp_path / "maps" / "mean"
    with_maps = nmt_cli.invoke("translate", "-m", str(ckpt), "-i", str(source), *FAST,
                               "--attention", str(maps), "--attention-layer", "0")
    assert with_maps.returncode == 0, with_maps.stderr.decode()
    assert with_maps.stdout == plain.stdout
    assert with_maps.stderr == plain.stderr == b""
    names = sorted(p.name for p in maps.iterdir())
    assert names == ["000001.png", "000003.png", "000006.png"]  # no temp files left
    mean_size = png_size(maps / "000001.png")
    per_head = tmp_path / "maps" / "all"
    first = test_lines[0].encode() + b"\n"
    heads = nmt_cli.invoke("translate", "-m", str(ckpt), *FAST, "--attention", str(per_head),
                           "--attention-heads", "all", input=first)
    assert heads.returncode == 0
    assert heads.stdout == plain.stdout.split(b"\n")[0] + b"\n"
    all_size = png_size(per_head / "000001.png")
    # the tiny model's 4 heads as a 2 x 2 grid of panels
    assert all_size[0] > 1.5 * mean_size[0] and all_size[1] > 1.5 * mean_size[1]


@pytest.mark.parametrize("args,message", [
    (("--attention-layer", "2"), b"--attention-layer 2 is out of range"),
    (("--attention-layer", "-3"), b"--attention-layer -3 is out of range"),
    (("--attention-heads", "max"), b"unknown --attention-heads 'max'"),
])
def test_cli_bad_attention_options_exit_2(ckpt: Path, tmp_path: Path, args: tuple[str, ...],
                                          message: bytes, nmt_cli: NmtCli) -> None:
    result = nmt_cli.invoke("translate", "-m", str(ckpt), *FAST, "--attention",
                            str(tmp_path / "maps"), *args, input=b"A dog.\n")
    assert result.returncode == 2
    assert message in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1
    assert result.stdout == b""


def test_cli_attention_path_is_a_file(ckpt: Path, tmp_path: Path, nmt_cli: NmtCli) -> None:
    taken = tmp_path / "taken"
    taken.write_text("x")
    result = nmt_cli.invoke("translate", "-m", str(ckpt), *FAST, "--attention", str(taken),
                            input=b"A dog.\n")
    assert result.returncode == 2 and b"not a directory" in result.stderr
