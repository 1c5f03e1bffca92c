"""Training: batching-aware loop, schedule, loss, checkpoint state, distributed helpers, logs.

`nmt.train.loop.train` is the entry point `nmt train` calls.
"""
