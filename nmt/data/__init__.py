"""Data, from a recipe to batches: everything `nmt prep` and `nmt bpe` run, and what
training reads.

- `recipes` (+ `local_recipe`): what a corpus is made of; `prep` runs a recipe through
  `download`, `extract`/`sources`, `clean` and `dedup` to plain text with a manifest.
- `vocab` (the joint sentencepiece model), `bpe` (trains it and binarizes), `binarize`.
- `dataset` (memory-mapped token ids) and `batching` (pure batch-by-token-count).

Atomic outputs and hashing live in nmt.fileio (shared with checkpoints and translation).
May import the shared top-level modules only; never the model, inference or training.
"""
