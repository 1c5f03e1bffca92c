"""Training: `nmt.train.loop.train` is the entry point `nmt train` calls.

- `step`: one training update as a function (`train_step`), which the loop and every
  benchmark call; `loss` (label-smoothed cross-entropy), `schedule` (learning rates by name).
- `loop`: orchestration only (feed, validate, save, log, stop); `feed`/`prefetch`/`sampling`
  bring batches, `validate`/`best` score them, `state`/`init_from` save and resume,
  `distributed` wraps torchrun, `ema`, `settings`, `log`.

May import anything in the library except the CLI.
"""
