"""Shared test helpers, no tests: `from helpers.MODULE import NAME` (pytest puts tests/ on
sys.path, as for conftest; a subprocess that imports them needs tests/ on PYTHONPATH).

- cli.py: the one runner of the `nmt` CLI (NmtCli, conftest's `nmt_cli` fixture): `run` in
  a subprocess, `invoke` in process, `popen`; CliResult; assert_one_line for error exits.
- models.py: tiny random Transformers and batches (VOCAB, make_model, random_batch,
  tiny_model_batch).
- checkpoints.py: a real BPE vocabulary and a tiny random-init checkpoint (make_vocab,
  make_checkpoint); RunsCode, a pickle that runs code when loaded.
- data.py: small binarized DATA dirs for training (write_text_data, multi30k_data,
  make_copy_data, train_one_thread) and the fault tests' run settings (MODEL_FLAGS,
  FAST_FLAGS and their configs).
- wmt.py: WMT14 and Multi30k mirror archives and recipe copies for the prep tests.
- serving.py: a real `nmt serve` on a free port with HTTP helpers (Server, free_port).
- native.py: code run where no kernel library was built (without_kernels): the C
  kernels' fallback.
- links.py: the links of Markdown files and the anchors (heading slugs, `<a id>`) they
  may name, as GitHub reads them (tests/test_docs.py).

Paths and threads (REPO, shared_data_path, torch_threads) stay in conftest.
"""
