"""The HTTP layer of `nmt serve` (Starlette): LibreTranslate's API, a native API, limits.

LibreTranslate-compatible, so its clients work unchanged: `POST /translate` (JSON or
form-encoded: q as a string or a list, source, target, format, alternatives, api_key) ->
{"translatedText": ...} mirroring q; `GET /languages`. Native, for what that API cannot
say: `POST /v1/translate`, `POST /v1/score`, `GET /v1/models`, `GET /v1/limits`,
`GET /health`. `GET /` is a page to try the models in a browser (nmt/serve/page/, a client
of these same endpoints; off with build_app(page=False)). Errors are
{"error": "..."} with LibreTranslate's status codes (400 bad request, 403 key, 413 too
large, 503 queue full with Retry-After, 500 a failure of ours, logged with its traceback);
the server goes on answering. The translation work is the Python API's, batched across
requests by nmt.serve.batcher.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import sys
import traceback
from collections.abc import Awaitable, Callable, Sequence
from contextlib import asynccontextmanager
from dataclasses import fields
from importlib import resources
from typing import Any, get_type_hints
from urllib.parse import parse_qs

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from nmt.api import TranslationResult
from nmt.config import DecodeConfig
from nmt.errors import UsageError
from nmt.serve.batcher import QueueFull
from nmt.serve.models import Limits, ServedModel, language_list

_D = DecodeConfig()
# Settings of DecodeConfig the server keeps to itself: its batches are its own.
SERVER_SIDE = {"max_tokens", "buffer_size"}


def option_types() -> dict[str, tuple[type, ...]]:
    """Native /v1/translate's options with the JSON types each takes: DecodeConfig's
    fields (the Python API's options; a float takes an int too) but the server's own
    batching, plus the API's per-call seed and target_prefix, and return_scores."""
    hints = get_type_hints(DecodeConfig)
    json_types = {int: (int,), float: (int, float), bool: (bool,), str: (str,)}
    options = {f.name: json_types[hints[f.name]] for f in fields(DecodeConfig)
               if f.name not in SERVER_SIDE}
    return {**options, "seed": (int,), "target_prefix": (list,), "return_scores": (bool,)}


OPTION_TYPES = option_types()


# Requests up to this many characters are measured in pieces on the event loop (tens of
# microseconds of sentencepiece); longer ones on a worker thread, so as not to stall it.
INLINE_COUNT_CHARS = 4096


class ApiError(Exception):
    """An expected failure of a request: its HTTP status and one-line message."""

    def __init__(self, status: int, message: str, headers: dict[str, str] | None = None
                 ) -> None:
        super().__init__(message)
        self.status, self.message, self.headers = status, message, headers or {}


Handler = Callable[[Request], Awaitable[Response]]


def build_app(models: Sequence[ServedModel], limits: Limits, api_keys: Sequence[str] = (),
              cors_origin: str | None = None, page: bool = True) -> Starlette:
    """The ASGI app over loaded `models`; `api_keys` non-empty makes a key mandatory;
    `page` serves the page to try them at `/` (else `/` is a 404, as any unknown path)."""
    state = _Server(list(models), limits, [k.encode("utf-8") for k in api_keys])

    @asynccontextmanager
    async def lifespan(_app: Starlette):
        yield
        for model in state.models:  # shutdown: finish what is queued, stop the workers
            await asyncio.to_thread(model.batcher.close)
            await asyncio.to_thread(model.translator.close)

    routes = [
        Route("/translate", _guard(state, state.libre_translate), methods=["POST"]),
        Route("/languages", _guard(state, state.languages, keyed=False),
              methods=["GET", "POST"]),
        Route("/v1/translate", _guard(state, state.native_translate), methods=["POST"]),
        Route("/v1/score", _guard(state, state.native_score), methods=["POST"]),
        Route("/v1/models", _guard(state, state.model_list, keyed=False), methods=["GET"]),
        Route("/v1/limits", _guard(state, state.limit_list, keyed=False), methods=["GET"]),
        Route("/health", _guard(state, state.health, keyed=False), methods=["GET"]),
    ]
    if page:
        routes += _page_routes()
    middleware = []
    if cors_origin:
        middleware.append(Middleware(CORSMiddleware, allow_origins=[cors_origin],
                                     allow_methods=["GET", "POST"],
                                     allow_headers=["Content-Type", "Authorization"]))
    return Starlette(routes=routes, middleware=middleware, lifespan=lifespan,
                     exception_handlers={HTTPException: _http_error})


# The page's files (nmt/serve/page/, package data) and the type each is served as.
PAGE_FILES = {"index.html": "text/html; charset=utf-8", "page.css": "text/css; charset=utf-8",
              "page.js": "text/javascript; charset=utf-8"}
# The page's headers: its script and styles from this server only (no inline script, no
# style attributes, no other origin), never framed; its types as sent (no sniffing).
PAGE_HEADERS = {
    "Content-Security-Policy": "default-src 'self'; script-src 'self'; style-src 'self'; "
                               "img-src 'self' data:; connect-src 'self'; base-uri 'none'; "
                               "form-action 'self'; frame-ancestors 'none'",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-cache",  # revalidated: a new nmt's page is seen at once
}


def _page_routes() -> list[Route]:
    """`GET /` (index.html) and `GET /page/NAME` for the page's other files, read once here
    from the installed package (so a wheel serves them too); other names are a 404."""
    folder = resources.files("nmt.serve") / "page"
    files = {name: (folder / name).read_bytes() for name in PAGE_FILES}

    def respond(name: str) -> Response:
        return Response(files[name], media_type=PAGE_FILES[name], headers=PAGE_HEADERS)

    async def index(_request: Request) -> Response:
        return respond("index.html")

    async def static(request: Request) -> Response:
        name = request.path_params["name"]
        if name not in files or name == "index.html":
            raise HTTPException(404, f"no page file {name!r}")
        return respond(name)

    return [Route("/", index, methods=["GET"]),
            Route("/page/{name}", static, methods=["GET"])]


class _Json(JSONResponse):
    """Starlette's JSON response, writing a surrogate (from a request echoed in a message:
    JSON may carry a lone one, UTF-8 cannot) as its \\uXXXX escape instead of failing."""

    def render(self, content: Any) -> bytes:
        return json.dumps(content, ensure_ascii=False, allow_nan=False, indent=None,
                          separators=(",", ":")).encode("utf-8", "backslashreplace")


async def _http_error(_request: Request, exc: Exception) -> Response:
    """Starlette's own 404/405 as {"error": ...} too."""
    assert isinstance(exc, HTTPException)
    return _Json({"error": exc.detail}, status_code=exc.status_code)


def _guard(state: _Server, handler: Callable[[Request, dict[str, Any]], Awaitable[Any]],
           keyed: bool = True) -> Handler:
    """Read and check the body (size, encoding, API key), call `handler(request, params)`
    and turn its value or ApiError into JSON; anything else is a logged 500."""

    async def endpoint(request: Request) -> Response:
        try:
            params = await state.params(request) if request.method == "POST" else {}
            if keyed:
                state.check_key(request, params)
            return _Json(await handler(request, params))
        except ApiError as err:
            return _Json({"error": err.message}, status_code=err.status,
                                headers=err.headers)
        except Exception as err:
            traceback.print_exc(file=sys.stderr)
            return _Json({"error": f"Cannot translate text: {err}"}, status_code=500)

    return endpoint


class _Server:
    """The state the endpoints share: models, limits, keys."""

    def __init__(self, models: list[ServedModel], limits: Limits, keys: list[bytes]) -> None:
        self.models, self.limits, self.keys = models, limits, keys

    # --- request plumbing -------------------------------------------------------------

    async def params(self, request: Request) -> dict[str, Any]:
        """The body as a dict: JSON object, or form fields (a repeated field is a list)."""
        size = request.headers.get("content-length")
        if size is not None and size.isdigit() and int(size) > self.limits.max_body_bytes:
            raise ApiError(413, f"request body of {size} bytes exceeds the limit of "
                           f"{self.limits.max_body_bytes} (--max-body-bytes)")
        body = bytearray()
        async for chunk in request.stream():
            body += chunk
            if len(body) > self.limits.max_body_bytes:
                raise ApiError(413, f"request body exceeds the limit of "
                               f"{self.limits.max_body_bytes} bytes (--max-body-bytes)")
        try:
            text = bytes(body).decode("utf-8")
        except UnicodeDecodeError as err:
            raise ApiError(400, f"Invalid request: body is not valid UTF-8 (byte "
                           f"{err.start})") from err
        kind = request.headers.get("content-type", "").split(";")[0].strip().lower()
        if kind == "application/json":
            try:
                params = json.loads(text) if text.strip() else {}
            except ValueError as err:
                raise ApiError(400, f"Invalid JSON format: {err}") from err
            except RecursionError as err:  # json's parser recurses once per nesting level
                raise ApiError(400, "Invalid JSON format: nested too deeply") from err
            if not isinstance(params, dict):
                raise ApiError(400, "Invalid JSON format: expected an object")
            return params
        if kind.startswith("multipart/"):
            raise ApiError(400, "Invalid request: multipart bodies are not supported; send "
                           "JSON or application/x-www-form-urlencoded")
        fields = parse_qs(text, keep_blank_values=True)
        return {k: v[0] if len(v) == 1 else v for k, v in fields.items()}

    def check_key(self, request: Request, params: dict[str, Any]) -> None:
        """With keys configured, the request's api_key (or Bearer token) must be one."""
        if not self.keys:
            return
        given = params.get("api_key")
        auth = request.headers.get("authorization", "")
        if not given and auth.lower().startswith("bearer "):
            given = auth[7:].strip()
        if not isinstance(given, str) or not given:
            raise ApiError(403, "Invalid API key: this server needs one (api_key)")
        candidate = given.encode("utf-8")
        if not any([hmac.compare_digest(candidate, key) for key in self.keys]):
            raise ApiError(403, "Invalid API key")

    def lines_of(self, items: list[Any], name: str) -> list[str]:
        """Check a request's texts against the limits."""
        for i, item in enumerate(items):
            if not isinstance(item, str):
                raise ApiError(400, f"Invalid request: {name}[{i}] is "
                               f"{type(item).__name__}, not a string")
            if len(item) > self.limits.max_chars:
                raise ApiError(413, f"Invalid request: {name}[{i}] has {len(item)} "
                               f"characters, over the limit of {self.limits.max_chars} "
                               "(--max-chars)")
        if len(items) > self.limits.max_lines:
            raise ApiError(413, f"Invalid request: {len(items)} lines exceed the limit of "
                           f"{self.limits.max_lines} (--max-lines)")
        return items

    async def translate(self, model: ServedModel, lines: list[str],
                        options: dict[str, Any]) -> list[TranslationResult]:
        """Queue `lines` on the model's batcher and wait for their results."""
        if not lines:
            tokens = 1
        elif sum(map(len, lines)) <= INLINE_COUNT_CHARS:  # microseconds: no thread hop
            tokens = sum(model.translator.count_tokens(lines))
        else:
            tokens = sum(await asyncio.to_thread(model.translator.count_tokens, lines))
        try:
            job = model.batcher.submit(lines, options, tokens)
        except QueueFull as err:
            raise ApiError(503, f"Server busy ({err}); retry shortly",
                           {"Retry-After": "1"}) from err
        try:
            return await asyncio.wrap_future(job.future)
        except UsageError as err:
            raise ApiError(400, f"Invalid request: {err}") from err
        finally:  # the next batch waits for this (see nmt/serve/batcher.py)
            model.batcher.delivered(job)

    def pick(self, source: str, target: str) -> tuple[ServedModel, str | None]:
        """The model for a language pair; `source` "auto" when one source is possible.
        Returns (model, detected source or None)."""
        if source == "auto":
            sources = sorted({m.source for m in self.models if m.target == target})
            if len(sources) != 1:
                choices = ", ".join(sources) or "none"
                raise ApiError(400, f"source auto needs exactly one source language "
                               f"translating into {target}; this server has: {choices}")
            source_code, detected = sources[0], sources[0]
        else:
            source_code, detected = source, None
        for model in self.models:
            if model.source == source_code and model.target == target:
                return model, detected
        known = {m.source for m in self.models} | {m.target for m in self.models}
        missing = source_code if source_code not in known else target
        raise ApiError(400, f"{missing} is not supported")

    def by_name(self, name: Any) -> ServedModel:
        if name is None:
            if len(self.models) == 1:
                return self.models[0]
            raise ApiError(400, "Invalid request: name the model (\"model\"); this server "
                           f"has {', '.join(m.name for m in self.models)}")
        for model in self.models:
            if model.name == name:
                return model
        raise ApiError(404, f"unknown model {name!r}; this server has "
                       f"{', '.join(m.name for m in self.models)}")

    # --- LibreTranslate -----------------------------------------------------------------

    async def libre_translate(self, _request: Request, params: dict[str, Any]) -> Any:
        q = params.get("q")
        if q is None or q == "" or q == []:
            raise ApiError(400, "Invalid request: missing q parameter")
        source, target = params.get("source"), params.get("target")
        if not source:
            raise ApiError(400, "Invalid request: missing source parameter")
        if not target:
            raise ApiError(400, "Invalid request: missing target parameter")
        text_format = params.get("format") or "text"
        if text_format != "text":
            raise ApiError(400, f"{text_format} format is not supported (this server "
                           "translates plain text: format=text)")
        alternatives = _integer(params.get("alternatives", 0), "alternatives")
        if not 0 <= alternatives <= 9:
            raise ApiError(400, "Invalid request: alternatives must be in 0..9")
        items = q if isinstance(q, list) else [q]
        texts = self.lines_of(items, "q")
        model, detected = self.pick(str(source), str(target))
        # A text's lines are translated one by one and joined again: paragraphs keep shape.
        lines = [line for text in texts for line in text.split("\n")]
        self.lines_of(lines, "lines of q")
        nbest = alternatives + 1
        beam = model.translator.tuned.get("beam", _D.beam)  # nmt tune's, else the paper's
        options = {"nbest": nbest, "beam": max(beam, nbest)}
        results = await self.translate(model, lines, options)
        translated, alts, start = [], [], 0
        for text in texts:
            parts = results[start:start + text.count("\n") + 1]
            start += len(parts)
            translated.append("\n".join(r.text for r in parts))
            alts.append(["\n".join(_nth(r, k) for r in parts) for k in range(1, nbest)])
        one = not isinstance(q, list)
        answer: dict[str, Any] = {"translatedText": translated[0] if one else translated}
        if alternatives:
            answer["alternatives"] = alts[0] if one else alts
        if detected is not None:
            found = {"confidence": 100.0, "language": detected}
            answer["detectedLanguage"] = found if one else [found] * len(texts)
        return answer

    async def languages(self, _request: Request, _params: dict[str, Any]) -> Any:
        return language_list(self.models)

    # --- native -------------------------------------------------------------------------

    async def native_translate(self, _request: Request, params: dict[str, Any]) -> Any:
        unknown = set(params) - set(OPTION_TYPES) - {"model", "inputs", "api_key"}
        if unknown:
            raise ApiError(400, f"Invalid request: unknown field(s) {', '.join(sorted(unknown))}"
                           f"; known: model, inputs, {', '.join(OPTION_TYPES)}")
        model = self.by_name(params.get("model"))
        inputs = params.get("inputs")
        if not isinstance(inputs, list):
            raise ApiError(400, "Invalid request: inputs must be a list of strings")
        lines = self.lines_of(inputs, "inputs")
        for i, line in enumerate(lines):
            if "\n" in line:
                raise ApiError(400, f"Invalid request: inputs[{i}] holds a line break; send "
                               "one line per input")
        options = {}
        for key, types in OPTION_TYPES.items():
            if key in params:
                value = params[key]
                if isinstance(value, bool) and bool not in types or not isinstance(value, types):
                    names = " or ".join(t.__name__ for t in types)
                    raise ApiError(400, f"Invalid request: {key} must be {names}")
                options[key] = value
        scores = bool(options.pop("return_scores", False))
        prefixes = options.get("target_prefix")
        if prefixes is not None and (len(prefixes) != len(lines) or not all(
                p is None or isinstance(p, str) for p in prefixes)):
            raise ApiError(400, "Invalid request: target_prefix needs one string (or null) "
                           "per input")
        try:
            DecodeConfig(**{k: v for k, v in options.items()
                            if k in DecodeConfig.__dataclass_fields__})
        except UsageError as err:
            raise ApiError(400, f"Invalid request: {err}") from err
        results = await self.translate(model, lines, options)
        detailed = scores or options.get("nbest", 1) > 1
        outputs = []
        for result in results:
            out: dict[str, Any] = {"text": result.text}
            if detailed:
                out["hypotheses"] = [{"text": h.text, "score": h.score, "log_prob": h.log_prob}
                                     for h in result.hypotheses]
            outputs.append(out)
        return {"model": model.name, "outputs": outputs}

    async def native_score(self, _request: Request, params: dict[str, Any]) -> Any:
        model = self.by_name(params.get("model"))
        sources, targets = params.get("sources"), params.get("targets")
        if not isinstance(sources, list) or not isinstance(targets, list):
            raise ApiError(400, "Invalid request: sources and targets must be lists of "
                           "strings")
        self.lines_of(sources, "sources")
        self.lines_of(targets, "targets")
        try:
            scored = await asyncio.to_thread(model.translator.score, sources, targets)
        except UsageError as err:
            raise ApiError(400, f"Invalid request: {err}") from err
        return {"model": model.name,
                "scores": [{"log_prob": s.log_prob, "tokens": s.tokens,
                            "normalized": s.normalized} for s in scored]}

    async def model_list(self, _request: Request, _params: dict[str, Any]) -> Any:
        return [model.info() for model in self.models]

    async def limit_list(self, _request: Request, _params: dict[str, Any]) -> Any:
        """What one request may hold and whether it needs a key: a client (the page) can
        warn before the server refuses."""
        return {"max_chars": self.limits.max_chars, "max_lines": self.limits.max_lines,
                "max_body_bytes": self.limits.max_body_bytes,
                "api_key_required": bool(self.keys)}

    async def health(self, _request: Request, _params: dict[str, Any]) -> Any:
        return {"status": "ok", "models": [m.name for m in self.models],
                "queued_lines": sum(m.batcher.queued_lines for m in self.models)}


def _integer(value: Any, name: str) -> int:
    """A form field or JSON value that must be an integer."""
    if isinstance(value, bool):
        raise ApiError(400, f"Invalid request: {name} must be an integer")
    try:
        return int(value)
    except (TypeError, ValueError) as err:
        raise ApiError(400, f"Invalid request: {name} must be an integer") from err


def _nth(result: TranslationResult, k: int) -> str:
    """The k-th hypothesis' text ("" when there are fewer)."""
    return result.hypotheses[k].text if k < len(result.hypotheses) else ""
