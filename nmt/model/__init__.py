"""The network of the paper, and nothing else: `transformer.Transformer` (embeddings,
encoder, decoder, shared output projection), `layers` (encoder/decoder layers, feed-forward),
`attention` (multi-head attention over fused SDPA; on a CPU the decoder step's attention
through the C kernel of `fused_attention`) and `dropout`.

Imports torch, nmt.config, nmt.errors, nmt.switches and nmt.kernels (the kernel's library)
only (tests/test_dependencies.py): no files besides the kernel's source, no CLI, no
search. Incremental decoding reaches the layers through their `incremental` methods, which
see the key/value caches (nmt/inference) through one interface, `incremental.LayerCache`:
project -> write -> attend.
"""
