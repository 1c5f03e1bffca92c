"""nmt: the Transformer of "Attention Is All You Need", end to end.

Where things live:
- `nmt.model`: the network (transformer, layers, attention, dropout).
- `nmt.inference`: search, incremental decoding and its caches, the translate pipeline,
  fast CPU linears, exporters.
- `nmt.train`: the training step, loss, schedules and the loop around them.
- `nmt.data`: recipes, prep, sentencepiece BPE, binarized datasets, batching.
- Shared, at the top: config (every default), checkpoint (the model file), errors, fileio,
  device, precision, score, average, special_ids, cores, host_memory, plot.

Dependencies point one way (tests/test_dependencies.py): data and model use only the
shared modules, inference adds those two, train adds inference; the CLI (cli/) sits above it
all. The one shared module that reaches up is checkpoint, whose `build_model` makes the
network and vocabulary from a model file (lazily imported).
"""

__version__ = "0.1.0"
