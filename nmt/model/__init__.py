"""The network of the paper, and nothing else: `transformer.Transformer` (embeddings,
encoder, decoder, shared output projection), `layers` (encoder/decoder layers, feed-forward),
`attention` (multi-head attention: SDPA on a GPU, the softmax written out on a CPU) and
`dropout`.

Imports torch, nmt.config and nmt.errors only (tests/test_dependencies.py): no C kernels, no
files, no CLI, no search, no caches. It computes whole sequences; incremental decoding and
the CPU's fast paths (C kernels, packed and int8 linears) live in nmt/inference, tested
against this network's own forward.
"""
