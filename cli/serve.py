"""`nmt serve -m MODEL [-m NAME=MODEL ...]`: translation over HTTP (LibreTranslate's API
and a native one), lines of concurrent requests batched together, and a page at `/` to try
the models in a browser (`--no-page`: none); needs nmt[serve]."""

from __future__ import annotations

import signal
import sys
from pathlib import Path

import typer

from nmt.cli.common import console, handle_errors
from nmt.config import RuntimeConfig
from nmt.errors import DataError, UsageError
from nmt.serve.models import Limits  # stdlib and nmt.api only: no serve extra needed

_R = RuntimeConfig()
_L = Limits()
SWITCH_INTERVAL_S = 0.0005  # GIL hand-over interval of the serving process (see below)


def command(
    models: list[str] = typer.Option(..., "--model", "-m", help="MODEL or NAME=MODEL: a "
                                     "checkpoint or run directory; repeat for several "
                                     "models (chosen by language pair, or by name in /v1)."),
    host: str = typer.Option("127.0.0.1", "--host", show_default=True,
                             help="Address to bind (0.0.0.0: every interface)."),
    port: int = typer.Option(5000, "--port", show_default=True, help="TCP port."),
    device: str = typer.Option(_R.device, "--device", show_default=True,
                               help="auto | cpu | cuda."),
    precision: str = typer.Option(_R.precision, "--precision", show_default=True,
                                  help="auto | fp32 | bf16 | fp16 | int8, as translate."),
    threads: int = typer.Option(None, "--threads", show_default="cores / workers",
                                help="Torch intra-op threads of each worker."),
    workers: int = typer.Option(None, "--workers", show_default="CPU: every core; GPU: 1",
                                help="Decoding processes per model sharing its weights "
                                "(CPU); batches of concurrent requests run side by side."),
    max_batch_tokens: int = typer.Option(_L.max_batch_tokens, "--max-batch-tokens",
                                         show_default=True,
                                         help="Source pieces one batch across requests "
                                         "may hold; sorted by length and cut into "
                                         "translate's --max-tokens batches."),
    max_wait_ms: float = typer.Option(_L.max_wait_ms, "--max-wait-ms", show_default=True,
                                      help="The longest a batch waits for more requests."),
    idle_ms: float = typer.Option(_L.idle_ms, "--idle-ms", show_default=True,
                                  help="A batch starts once no request has come for this "
                                  "long (and the previous batch's answers are out)."),
    max_queue_lines: int = typer.Option(4096, "--max-queue-lines", show_default=True,
                                        help="Lines queued per model before new requests "
                                        "get 503 with Retry-After."),
    max_body_bytes: int = typer.Option(1 << 20, "--max-body-bytes", show_default=True,
                                       help="Largest request body (413 above)."),
    max_lines: int = typer.Option(256, "--max-lines", show_default=True,
                                  help="Lines per request (413 above)."),
    max_chars: int = typer.Option(5000, "--max-chars", show_default=True,
                                  help="Characters per line (413 above)."),
    api_keys: Path = typer.Option(None, "--api-keys", show_default="no keys",
                                  help="File of API keys, one a line: requests must carry "
                                  "one (api_key, or Authorization: Bearer KEY), else 403."),
    cors_origin: str = typer.Option(None, "--cors-origin", show_default="CORS off",
                                    help="Origin allowed to call from a browser."),
    page: bool = typer.Option(True, "--page/--no-page", show_default=True,
                              help="Serve a page to try the models at / (the API is the "
                              "same either way)."),
) -> None:
    """Serve models over HTTP until SIGTERM or Ctrl-C (then finish what is in flight and
    exit 0). Ready when it prints its URL: every model is loaded."""
    with handle_errors("serve"):
        try:
            import uvicorn

            from nmt.serve.app import build_app
            from nmt.serve.models import Limits, load_models
        except ImportError as err:
            raise UsageError(f"nmt serve needs starlette and uvicorn ({err.name} is "
                             "missing): pip install 'nmt[serve]'") from err
        for name, value in (("--port", port), ("--max-batch-tokens", max_batch_tokens),
                            ("--max-queue-lines", max_queue_lines),
                            ("--max-body-bytes", max_body_bytes), ("--max-lines", max_lines),
                            ("--max-chars", max_chars)):
            if value < 0 or (value == 0 and name != "--port"):
                raise UsageError(f"{name} must be positive, got {value}")
        for name, wait in (("--max-wait-ms", max_wait_ms), ("--idle-ms", idle_ms)):
            if wait < 0:
                raise UsageError(f"{name} must be >= 0, got {wait}")
        keys = _read_keys(api_keys) if api_keys is not None else []
        limits = Limits(max_body_bytes, max_lines, max_chars, max_batch_tokens, max_wait_ms,
                        idle_ms, max_queue_lines)
        from nmt.cores import available_cores
        from nmt.device import resolve_device
        from nmt.inference.workers import plan_workers

        plan = plan_workers(workers, threads, resolve_device(device).type, available_cores())
        if plan.note:
            console.print(f"nmt serve: {plan.note}", markup=False, soft_wrap=True)
        served = load_models(models, limits, device, precision, plan.threads, plan.workers)
        app = build_app(served, limits, keys, cors_origin, page)
        url = f"http://{host}:{port}"
        for model in served:
            console.print(f"nmt serve: {model.name} ({model.source} -> {model.target}, "
                          f"{model.translator.precision} on {model.translator.device}) from "
                          f"{model.translator.paths[0]}", markup=False, soft_wrap=True)
        first = served[0]
        browse = "open it in a browser, or " if page else ""
        console.print(f"nmt serve: ready on {url}  ({browse}try: curl -s {url}/translate -H "
                      f"'Content-Type: application/json' -d '{{\"q\": \"Hello\", "
                      f"\"source\": \"{first.source}\", \"target\": \"{first.target}\"}}')",
                      markup=False, soft_wrap=True)
        # uvicorn stops accepting on SIGTERM, finishes the requests in flight, then raises
        # the signal again for the handler found here: make that handler exit 0.
        signal.signal(signal.SIGTERM, lambda _sig, _frame: sys.exit(0))
        # The event loop and the decoding thread share the GIL; torch releases it around
        # every op and must win it back: at the default 5 ms switch interval the decoder
        # can wait that long per op while the loop parses requests.
        sys.setswitchinterval(SWITCH_INTERVAL_S)
        uvicorn.run(app, host=host, port=port, log_level="warning", access_log=False,
                    timeout_graceful_shutdown=60)


def _read_keys(path: Path) -> list[str]:
    """One key a line; blank lines and # comments skipped; at least one key."""
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as err:
        raise DataError(f"{path}: cannot read the API keys ({err})") from err
    keys = [line.strip() for line in text.splitlines()
            if line.strip() and not line.lstrip().startswith("#")]
    if not keys:
        raise DataError(f"{path}: no API key in it (one a line)")
    return keys
