"""The training tests' DATA builders (tests/helpers/data.py) build what training reads."""

from __future__ import annotations

from helpers.data import make_copy_data

from nmt.data.dataset import ParallelData, load_vocab


def test_fixture_data_reads_back(tmp_path):
    data_dir = make_copy_data(tmp_path / "data", n_train=50, n_valid=5)
    vocab = load_vocab(data_dir)
    train = ParallelData.open(data_dir, "train")
    assert len(train) == 50
    first_src = (data_dir / "train.src").read_text().splitlines()[0]
    assert vocab.decode([train.src[0].tolist()]) == [first_src]
    assert (train.src.lengths == train.tgt.lengths).all()  # copy task
