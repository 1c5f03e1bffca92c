"""The special token ids, defined once: every vocabulary is trained with them (`nmt bpe`)
and every sequence uses them. A module of their own so that code needing only the ids
(search, batching) does not import sentencepiece."""

PAD_ID = 0
UNK_ID = 1
BOS_ID = 2
EOS_ID = 3
