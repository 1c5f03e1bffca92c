"""Using a trained model: everything between a checkpoint and translated text.

- `search`: beam search, greedy and sampling as pure functions around a step function
  (torch and the special ids only; tested with scripted probabilities).
- `decoding`: the model as that step function (incremental decoding, one position a step:
  each layer's step in `layer_step`, tested equal to the network's forward), over a
  key/value cache that no other module sees, `kv_cache.GroupedCache` (the grouped layout;
  tested equal to the readable reference in tests/helpers/plain_cache.py).
- `translate`: the streaming pipeline of `nmt translate` (read, sort, batch, search, write
  in input order) and the `Engine` that loads a model once.
- `backends`: which faster CPU linear (and kernel) runs, by precision and CPU, from one table;
  `packed_linear`, `mkl_linear`, `int8_linear`, `kernel_linear`: those linears;
  `fused_attention`, `add_norm`, `step_topk`, `native_step`: the C kernels' Python sides.
- `attention_map`: encoder-decoder attention heatmaps.
- `export`: exporters for other engines: CTranslate2 (`export.ct2`), Hugging Face
  transformers (`export.hf`), sharing `export.common`.

May import the shared top-level modules, nmt.model and nmt.data; never nmt.train.
"""
