"""nmt: the Transformer of "Attention Is All You Need", end to end.

The Python API (nmt/api.py), importable without loading torch:

    from nmt import Translator
    translator = Translator.load("runs/multi30k-en-de")
    translator.translate(["A man rides a bike."])

Where things live:
- `nmt.model`: the network (transformer, layers, attention, dropout), the reference.
- `nmt.inference`: search, incremental decoding and its caches, the translate pipeline,
  the table of CPU backends and the fast paths, exporters, the decoding settings `nmt
  tune` chooses (tune, tuned).
- `nmt.kernels`: the C kernels, built at install per ISA level, loaded per CPU.
- `nmt.train`: the training step, loss, schedules and the loop around them.
- `nmt.data`: recipes, prep, sentencepiece BPE, binarized datasets, batching.
- `nmt.api`: the Python API above, a thin layer over `nmt.inference`.
- Shared, at the top: config (every default), checkpoint (the model file), errors, fileio,
  device, precision, score, average, special_ids, cores, host_memory, plot; doctor (what
  `nmt doctor` reports) reads them all.

Dependencies point one way (tests/test_dependencies.py): data and model use only the
shared modules, inference adds those two, train adds inference; the CLI (`nmt.cli`, whose
source is the repository's top-level cli/) sits above it all. The one shared module that
reaches up is checkpoint, whose `load_model` makes the network and vocabulary from a model
file (lazily imported).
"""

__version__ = "0.1.0"

_API = ("Translator", "TranslationResult", "ScoredText", "ScoreResult")


def __getattr__(name: str) -> object:
    """`from nmt import Translator` loads nmt.api on first use, keeping `import nmt` light."""
    if name in _API:
        from nmt import api

        return getattr(api, name)
    raise AttributeError(f"module 'nmt' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted([*globals(), *_API])
