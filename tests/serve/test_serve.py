"""`nmt serve` as a client sees it: a real server process on a free loopback port, spoken
to over HTTP (LibreTranslate's own Python client among the clients), never in process.

Covers the LibreTranslate API (JSON and form bodies, q as a string and a list,
alternatives, auto source, /languages), the native API, batching across 64 concurrent
requests (each answered as it is alone), every bad input with its status and message (the
server answering the next request), API keys, and SIGTERM with requests in flight."""

from __future__ import annotations

import json
import signal
import socket
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
from helpers.checkpoints import make_checkpoint, make_vocab
from helpers.serving import Server

pytest.importorskip("starlette", reason="needs the serve extra: pip install '.[serve]'")
pytest.importorskip("uvicorn", reason="needs the serve extra: pip install '.[serve]'")
pytestmark = pytest.mark.slow  # server processes: seconds each


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """A tiny en-de model and the same network recorded as fr-de."""
    import torch
    from conftest import shared_data_path

    from nmt.checkpoint import save_checkpoint

    work = tmp_path_factory.mktemp("serve")
    en_de = make_checkpoint(make_vocab(shared_data_path("multi30k"), work), work / "en-de.pt")
    payload = torch.load(en_de, weights_only=True)
    payload["meta"] = {**payload["meta"], "src_lang": "fr"}
    fr_de = work / "fr-de.pt"
    save_checkpoint(payload, fr_de)
    return en_de, fr_de


@pytest.fixture(scope="module")
def server(models: tuple[Path, Path]) -> Iterator[Server]:
    srv = Server("-m", models[0], "--max-lines", "40", "--max-chars", "300",
                 "--max-body-bytes", "20000")
    yield srv
    assert srv.stop() == 0


@pytest.fixture(scope="module")
def lines() -> list[str]:
    from conftest import shared_data_path

    text = shared_data_path("multi30k", "test_2016_flickr.en").read_text(encoding="utf-8")
    return text.split("\n")[:200]


def test_libretranslate_json_form_and_its_own_client(server: Server, lines: list[str]
                                                     ) -> None:
    from libretranslatepy import LibreTranslateAPI

    status, one, _ = server.post("/translate", {"q": lines[0], "source": "en", "target": "de"})
    assert status == 200 and set(one) == {"translatedText"} and one["translatedText"]
    status, many, _ = server.post("/translate", {"q": lines[:3], "source": "en",
                                                 "target": "de"})
    assert status == 200 and many["translatedText"][0] == one["translatedText"]
    assert len(many["translatedText"]) == 3
    status, form, _ = server.form("/translate", [("q", lines[0]), ("source", "en"),
                                                 ("target", "de")])
    assert status == 200 and form == one
    client = LibreTranslateAPI(server.url)  # LibreTranslate's client, not ours
    assert client.translate(lines[0], "en", "de") == one["translatedText"]
    assert client.languages() == [{"code": "de", "name": "German", "targets": []},
                                  {"code": "en", "name": "English", "targets": ["de"]}]
    status, alt, _ = server.post("/translate", {"q": lines[1], "source": "auto",
                                                "target": "de", "alternatives": 2})
    assert status == 200 and alt["detectedLanguage"] == {"confidence": 100.0,
                                                         "language": "en"}
    assert len(alt["alternatives"]) == 2 and alt["translatedText"] not in alt["alternatives"]
    status, para, _ = server.post("/translate", {"q": f"{lines[0]}\n{lines[1]}",
                                                 "source": "en", "target": "de"})
    assert para["translatedText"] == "\n".join(many["translatedText"][:2])  # lines kept


def test_native_api(server: Server, lines: list[str]) -> None:
    status, out, _ = server.post("/v1/translate", {"inputs": [lines[0], ""],
                                                   "return_scores": True, "beam": 2})
    assert status == 200 and out["model"] == "en-de" and out["outputs"][1] == {
        "text": "", "hypotheses": []}
    hyp = out["outputs"][0]["hypotheses"][0]
    assert hyp["text"] == out["outputs"][0]["text"] and hyp["log_prob"] < 0
    status, best, _ = server.post("/v1/translate", {"inputs": [lines[0]], "nbest": 3})
    assert status == 200 and len(best["outputs"][0]["hypotheses"]) == 3
    status, pre, _ = server.post("/v1/translate", {"inputs": [lines[0]],
                                                   "target_prefix": ["Ein Mann"]})
    assert status == 200 and pre["outputs"][0]["text"].startswith("Ein Mann")
    status, scored, _ = server.post("/v1/score", {"sources": lines[:2],
                                                  "targets": ["Ein Mann.", ""]})
    assert status == 200 and [s["tokens"] for s in scored["scores"]][1] == 1
    status, listed, _ = server.get("/v1/models")
    assert status == 200 and listed[0]["name"] == "en-de" and listed[0]["parameters"] > 0
    assert listed[0]["precision"] == "fp32" and listed[0]["device"] == "cpu"
    assert server.get("/health")[1]["status"] == "ok"


def test_concurrent_requests_answer_as_alone(server: Server, lines: list[str]) -> None:
    """64 requests of 1-20 lines from 16 threads at once: batched together, each answered
    exactly as when sent alone."""
    requests = [lines[(7 * i) % 180:(7 * i) % 180 + 1 + (i * 5) % 20] for i in range(64)]
    alone = [server.post("/translate", {"q": q, "source": "en", "target": "de"})[1]
             for q in requests]
    with ThreadPoolExecutor(16) as pool:
        together = list(pool.map(lambda q: server.post("/translate", {
            "q": q, "source": "en", "target": "de"}), requests))
    assert [status for status, _, _ in together] == [200] * 64
    assert [body for _, body, _ in together] == alone


@pytest.mark.parametrize(("make", "status", "message"), [
    (lambda s: s.post("/translate", {"source": "en", "target": "de"}), 400,
     "Invalid request: missing q parameter"),
    (lambda s: s.post("/translate", {"q": "x", "target": "de"}), 400,
     "Invalid request: missing source parameter"),
    (lambda s: s.post("/translate", {"q": "x", "source": "en", "target": "xx"}), 400,
     "xx is not supported"),
    (lambda s: s.post("/translate", {"q": "x", "source": "en", "target": "de",
                                     "format": "html"}), 400, "html format is not supported"),
    (lambda s: s.post("/translate", {"q": ["x", 3], "source": "en", "target": "de"}), 400,
     "q[1] is int, not a string"),
    (lambda s: s.post("/translate", {"q": "x", "source": "en", "target": "de",
                                     "alternatives": "many"}), 400,
     "alternatives must be an integer"),
    (lambda s: s.request("/translate", b"{not json", "application/json"), 400,
     "Invalid JSON format"),
    (lambda s: s.request("/translate", b"[1, 2]", "application/json"), 400,
     "expected an object"),
    (lambda s: s.request("/translate", b"q=\xff\xfe&source=en&target=de",
                         "application/x-www-form-urlencoded"), 400, "not valid UTF-8"),
    (lambda s: s.post("/translate", {"q": ["x"] * 41, "source": "en", "target": "de"}), 413,
     "41 lines exceed the limit of 40 (--max-lines)"),
    (lambda s: s.post("/translate", {"q": "x" * 301, "source": "en", "target": "de"}), 413,
     "over the limit of 300 (--max-chars)"),
    (lambda s: s.request("/translate", b"q=" + b"x" * 20001, "application/x-www-form-urlencoded"),
     413, "(--max-body-bytes)"),
    (lambda s: s.post("/v1/translate", {"model": "zz", "inputs": ["x"]}), 404,
     "unknown model 'zz'"),
    (lambda s: s.post("/v1/translate", {"inputs": ["x"], "beam": "four"}), 400,
     "beam must be int"),
    (lambda s: s.post("/v1/translate", {"inputs": ["x"], "nbest": 9}), 400,
     "exceeds --beam"),
    (lambda s: s.post("/v1/translate", {"inputs": ["x"], "colour": 1}), 400,
     "unknown field(s) colour"),
    (lambda s: s.post("/v1/translate", {"inputs": "x"}), 400, "inputs must be a list"),
    (lambda s: s.post("/v1/score", {"sources": ["x"], "targets": []}), 400,
     "1 sources but 0 targets"),
    (lambda s: s.get("/nowhere"), 404, "Not Found"),
    (lambda s: s.request("/translate", b'{"q": ' + b"[" * 5000 + b"]" * 5000 + b"}",
                         "application/json"), 400, "Invalid JSON format: nested too deeply"),
    (lambda s: s.post("/translate", {"q": "x", "source": "en", "target": "\ud800"}), 400,
     "\ud800 is not supported"),  # echoed as JSON's escape: UTF-8 cannot hold it
])
def test_bad_input_gets_its_status_and_the_server_goes_on(server: Server, make: Any,
                                                          status: int, message: str) -> None:
    got, body, _ = make(server)
    assert got == status and set(body) == {"error"} and message in body["error"], body
    assert server.post("/translate", {"q": "A dog.", "source": "en", "target": "de"})[0] == 200


def test_a_lone_surrogate_is_translated_as_u_fffd(server: Server) -> None:
    """JSON may carry a lone surrogate, UTF-8 cannot: it is read as U+FFFD (as invalid
    UTF-8 is in `nmt translate`'s input), so the line translates like one holding U+FFFD."""
    want = server.post("/v1/translate", {"inputs": ["A dog \ufffd runs."]})
    got = server.post("/v1/translate", {"inputs": ["A dog \ud800 runs."]})
    assert got[0] == 200 and got[1] == want[1], got
    libre = server.post("/translate", {"q": "A dog \ud800 runs.", "source": "en",
                                       "target": "de"})
    assert libre[0] == 200 and libre[1]["translatedText"] == want[1]["outputs"][0]["text"]
    score = server.post("/v1/score", {"sources": ["A dog \udfff."], "targets": ["\ud800"]})
    assert score[0] == 200 and score[1] == server.post(
        "/v1/score", {"sources": ["A dog \ufffd."], "targets": ["\ufffd"]})[1]


def test_client_that_disconnects_does_not_wedge_the_server(server: Server) -> None:
    body = json.dumps({"q": ["A dog runs."] * 30, "source": "en", "target": "de"}).encode()
    for cut in (False, True):
        with socket.create_connection(("127.0.0.1", server.port)) as sock:
            head = (f"POST /translate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json"
                    f"\r\nContent-Length: {len(body)}\r\n\r\n").encode()
            sock.sendall(head + (body[:20] if cut else body))
        time.sleep(0.2)
    assert server.post("/translate", {"q": "A dog.", "source": "en", "target": "de"})[0] == 200


def test_two_models_auto_source_and_api_keys(models: tuple[Path, Path],
                                             tmp_path: Path) -> None:
    keys = tmp_path / "keys.txt"
    keys.write_text("# operators\nsecret-1\nsecret-2\n", encoding="utf-8")
    srv = Server("-m", models[0], "-m", f"fren={models[1]}", "--api-keys", keys)
    try:
        ask = {"q": "Un chien.", "source": "fr", "target": "de"}
        assert srv.post("/translate", ask)[:2] == (403, {
            "error": "Invalid API key: this server needs one (api_key)"})
        assert srv.post("/translate", {**ask, "api_key": "secret-3"})[0] == 403
        assert srv.post("/translate", {**ask, "api_key": "secret-2"})[0] == 200
        bearer = {"Authorization": "Bearer secret-1"}
        assert srv.post("/translate", ask, headers=bearer)[0] == 200
        status, body, _ = srv.post("/translate", {**ask, "source": "auto",
                                                  "api_key": "secret-1"})
        assert status == 400 and "this server has: en, fr" in body["error"]
        status, body, _ = srv.post("/v1/translate", {"inputs": ["x"], "api_key": "secret-1"})
        assert status == 400 and "name the model" in body["error"]
        status, body, _ = srv.post("/v1/translate", {"inputs": ["x"], "model": "fren",
                                                     "api_key": "secret-1"})
        assert status == 200 and body["model"] == "fren"
        assert srv.get("/languages")[1][1] == {"code": "en", "name": "English",
                                              "targets": ["de"]}
    finally:
        assert srv.stop() == 0


def test_full_queue_is_503_with_retry_after(models: tuple[Path, Path]) -> None:
    """A batch waiting 300 ms for company holds the queue's 2 lines: others are refused."""
    srv = Server("-m", models[0], "--max-queue-lines", "2", "--max-wait-ms", "300",
                 "--idle-ms", "300")
    try:
        ask = {"q": ["A dog.", "A cat."], "source": "en", "target": "de"}
        with ThreadPoolExecutor(4) as pool:
            first = pool.submit(srv.post, "/translate", ask)
            time.sleep(0.1)
            refused = srv.post("/translate", ask)
            assert first.result()[0] == 200
        status, body, headers = refused
        assert status == 503 and headers.get("Retry-After") == "1", body
        assert srv.post("/translate", ask)[0] == 200  # served again once the queue drains
    finally:
        assert srv.stop() == 0


def test_sigterm_finishes_requests_in_flight(models: tuple[Path, Path],
                                             lines: list[str]) -> None:
    srv = Server("-m", models[0], "--max-wait-ms", "400", "--idle-ms", "400")
    asks = [{"q": lines[i:i + 3], "source": "en", "target": "de"} for i in range(0, 24, 3)]
    expected = [srv.post("/translate", ask)[1] for ask in asks]
    results: list[Any] = []

    def send(ask: dict) -> None:
        results.append(srv.post("/translate", ask))

    threads = [threading.Thread(target=send, args=(ask,)) for ask in asks]
    for thread in threads:
        thread.start()
    time.sleep(0.2)  # all sent, the batch still waiting for company
    srv.proc.send_signal(signal.SIGTERM)
    for thread in threads:
        thread.join(60)
    assert srv.stop() == 0
    assert sorted(json.dumps(b) for _, b, _ in results) == sorted(
        json.dumps(b) for b in expected)
    assert all(status == 200 for status, _, _ in results)
