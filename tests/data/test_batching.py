"""Token batching against a slow reference, epoch shuffling, sharding and collation."""

from __future__ import annotations

import numpy as np
import pytest
from helpers.batching import batch_by_tokens_slow

from nmt.data.batching import batch_by_tokens, collate, epoch_order, shard
from nmt.data.vocab import BOS_ID, EOS_ID, PAD_ID


@pytest.mark.parametrize("seed", range(200))
def test_fast_batching_equals_reference(seed):
    rng = np.random.default_rng(seed)
    n = int(rng.integers(0, 300))
    top = int(rng.integers(1, 120))
    src = rng.integers(0, top, n)
    tgt = np.clip(src + rng.integers(-5, 6, n), 0, None) if seed % 2 else rng.integers(0, top, n)
    max_tokens = int(rng.integers(1, 400))
    max_len = int(rng.integers(1, 130))
    fast = batch_by_tokens(src, tgt, max_tokens, max_len)
    slow = batch_by_tokens_slow(src.tolist(), tgt.tolist(), max_tokens, max_len)
    assert fast.skipped == slow.skipped
    assert len(fast.batches) == len(slow.batches)
    for a, b in zip(fast.batches, slow.batches, strict=True):
        np.testing.assert_array_equal(a, b)


def test_batches_respect_budget_and_cover_every_kept_pair():
    rng = np.random.default_rng(0)
    src, tgt = rng.integers(0, 80, 5000), rng.integers(0, 80, 5000)
    result = batch_by_tokens(src, tgt, max_tokens=500, max_len=64)
    costs = np.maximum(src, tgt) + 1
    seen = np.concatenate(result.batches)
    assert len(seen) == len(set(seen.tolist()))
    assert set(seen.tolist()) == set(np.flatnonzero(costs <= 64).tolist())
    assert result.skipped == int((costs > 64).sum())
    for batch in result.batches:
        assert costs[batch].max() * len(batch) <= 500


def test_epoch_order_is_seeded_and_truncated_for_ranks():
    a, b = epoch_order(11, seed=3, epoch=1), epoch_order(11, seed=3, epoch=1)
    np.testing.assert_array_equal(a, b)
    assert sorted(a.tolist()) == list(range(11))
    assert not np.array_equal(a, epoch_order(11, seed=3, epoch=2))
    two = epoch_order(11, seed=3, epoch=1, world_size=2)
    assert len(two) == 10
    r0, r1 = shard(two, 0, 2), shard(two, 1, 2)
    assert len(r0) == len(r1) == 5
    assert sorted(np.concatenate([r0, r1]).tolist()) == sorted(two.tolist())


def test_collate_layout():
    batch = collate([np.array([5, 6, 7]), np.array([8])], [np.array([9]), np.array([10, 11])])
    assert batch.src.tolist() == [[5, 6, 7, EOS_ID], [8, EOS_ID, PAD_ID, PAD_ID]]
    assert batch.tgt_in.tolist() == [[BOS_ID, 9, PAD_ID], [BOS_ID, 10, 11]]
    assert batch.tgt_out.tolist() == [[9, EOS_ID, PAD_ID], [10, 11, EOS_ID]]
    assert (batch.src_tokens, batch.tgt_tokens) == (6, 5)


def _translate_batches_reference(lengths, max_tokens):
    """translate's former batcher: length order, a batch closes when the next line would
    overflow it, an over-long line goes alone."""
    order = sorted(range(len(lengths)), key=lambda i: lengths[i])
    batches, current = [], []
    for i in order:
        if current and (len(current) + 1) * (lengths[i] + 1) > max_tokens:
            batches.append(current)
            current = []
        current.append(i)
    if current:
        batches.append(current)
    return batches


def test_translation_batches_are_training_batches_of_the_source_side():
    """One batcher for training and translation: source_batches (batch_by_tokens with no
    target side, every line kept) equals the former translate batcher exactly."""
    from nmt.inference.translate import source_batches

    rng = np.random.default_rng(7)
    for _ in range(300):
        n = int(rng.integers(1, 60))
        lengths = rng.integers(0, 80, n).tolist()
        max_tokens = int(rng.integers(1, 400))
        assert source_batches(lengths, max_tokens) == _translate_batches_reference(
            lengths, max_tokens), (lengths, max_tokens)
