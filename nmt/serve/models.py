"""The models a server holds: each loaded once through the Python API, named, with its
language pair and its request batcher; chosen by name or by language pair."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from nmt.api import Translator
from nmt.errors import UsageError
from nmt.serve.batcher import Batcher

# English names of the language codes a request may use (LibreTranslate's /languages
# lists them); other codes are shown as themselves.
LANGUAGE_NAMES = {
    "ar": "Arabic", "cs": "Czech", "de": "German", "en": "English", "es": "Spanish",
    "et": "Estonian", "fi": "Finnish", "fr": "French", "hi": "Hindi", "it": "Italian",
    "ja": "Japanese", "kk": "Kazakh", "lt": "Lithuanian", "lv": "Latvian", "nl": "Dutch",
    "pl": "Polish", "pt": "Portuguese", "ro": "Romanian", "ru": "Russian", "tr": "Turkish",
    "uk": "Ukrainian", "zh": "Chinese",
}


@dataclass(frozen=True)
class Limits:
    """What one request may hold, and how requests are batched."""

    max_body_bytes: int = 1 << 20
    max_lines: int = 256  # lines (q items, inputs) per request
    max_chars: int = 5000  # characters per line
    # Source pieces one call of the engine may hold: two of translate's --max-tokens
    # batches. The engine sorts a call's lines by length and cuts them into max-tokens
    # batches (memory stays bounded by those), so a call that spans several sorts lines of
    # many requests together, as `nmt translate` sorts its buffer, and a burst of
    # concurrent requests fits one call instead of waiting for two (docs/serving.md).
    max_batch_tokens: int = 16384
    max_wait_ms: float = 30.0  # the longest a batch waits for company
    idle_ms: float = 3.0  # a batch starts once no request has come for this long
    max_queue_lines: int = 4096  # lines queued before new requests get 503


@dataclass
class ServedModel:
    """One model the server answers with."""

    name: str
    source: str
    target: str
    translator: Translator
    batcher: Batcher

    def info(self) -> dict[str, Any]:
        """What GET /v1/models says about it."""
        config = self.translator.model_config
        return {"name": self.name, "source": self.source, "target": self.target,
                "architecture": config, "parameters": self.translator.parameters,
                "device": self.translator.device, "precision": self.translator.precision,
                "path": str(self.translator.paths[0]),
                "decoding": self.translator.tuned}  # nmt tune's choice ({}: the paper's)


def parse_model_spec(spec: str) -> tuple[str | None, Path]:
    """`NAME=MODEL` or `MODEL` -> (name or None, path)."""
    name, sep, path = spec.partition("=")
    if sep and name and "/" not in name:
        return name, Path(path)
    return None, Path(spec)


def load_models(specs: Sequence[str], limits: Limits, device: str, precision: str,
                threads: int | None, workers: int = 1) -> list[ServedModel]:
    """Load every `-m` spec; a model's pair comes from its checkpoint, or from a NAME
    spelled SRC-TGT (e.g. `-m en-de=model.pt`) for a model that records none. Each model
    gets `workers` decoding processes (`threads` torch threads each; see Translator.load)
    and as many batches in flight."""
    served: list[ServedModel] = []
    for spec in specs:
        name, path = parse_model_spec(spec)
        translator = Translator.load(path, device=device, precision=precision,
                                     threads=threads, workers=workers)
        source, target = translator.languages
        if not (source and target):
            pair = (name or "").split("-")
            if len(pair) != 2 or not all(pair):
                raise UsageError(f"{path}: the checkpoint records no language pair (made by an "
                                 "earlier nmt, or from data without a manifest); name it "
                                 "by its pair, e.g. -m en-de=MODEL")
            source, target = pair
        name = name or f"{source}-{target}"
        if any(m.name == name for m in served):
            raise UsageError(f"two models named {name!r}; name them: -m NAME=MODEL")
        batcher = Batcher(_runner(translator), limits.max_batch_tokens, limits.max_wait_ms,
                          limits.max_queue_lines, name, idle_ms=limits.idle_ms,
                          parallel=translator.workers)
        served.append(ServedModel(name, source, target, translator, batcher))
    return served


def _runner(translator: Translator):
    def run(lines: list[str], options: dict[str, Any]) -> list[Any]:
        return translator.translate_hypotheses(lines, **options)

    return run


def language_list(models: Sequence[ServedModel]) -> list[dict[str, Any]]:
    """LibreTranslate's /languages: each source language with its targets."""
    targets: dict[str, list[str]] = {}
    for model in models:
        targets.setdefault(model.source, [])
        if model.target not in targets[model.source]:
            targets[model.source].append(model.target)
        targets.setdefault(model.target, [])
    return [{"code": code, "name": LANGUAGE_NAMES.get(code, code), "targets": sorted(t)}
            for code, t in sorted(targets.items())]
