"""Cleaning rules, their counts, and the order-keeping multi-process map."""

from __future__ import annotations

from nmt.data.clean import Counts, PairCleaner, clean_pairs, ordered_map, without_line_breaks
from nmt.recipes import Cleaning


def test_normalization_and_non_printing():
    cleaner = PairCleaner(Cleaning(), "en", "de")
    assert cleaner.normalize("A man\x07 rides  a «horse» .", 0) == 'A man rides a "horse" .'
    assert cleaner.normalize("\ufeffZero\u200bwidth\t tab ", 1) == "Zero width tab"
    # No-break spaces are printing characters (Zs): kept unless normalization says otherwise.
    raw = PairCleaner(Cleaning(normalize_punctuation=False), "en", "de")
    assert raw.normalize("a\u00a0b", 0) == "a b"  # \s collapses it to a plain space
    assert raw.normalize("x\x00y", 0) == "x y"


def test_filters_count_each_rule():
    rules = Cleaning(min_words=2, max_words=5, max_ratio=1.5)
    pairs = [("a b", "c d"), ("", "x"), ("a", "b"), ("1 2 3 4 5 6", "1 2 3 4 5 6"),
             ("a b c d", "a b"), ("a b c", "a b")]
    counts = Counts()
    kept = list(clean_pairs(pairs, rules, "en", "de", counts))
    assert kept == [("a b", "c d"), ("a b c", "a b")]
    assert counts.to_dict() == {"input": 6, "after_empty": 5, "after_min_words": 4,
                                "after_max_words": 3, "after_max_ratio": 2, "output": 2}


def test_two_workers_keep_order_and_match_one_worker():
    pairs = [(f"line {i} „quoted“", f"Zeile {i}" + " x" * (i % 4)) for i in range(3000)]
    one, two = Counts(), Counts()
    a = list(clean_pairs(pairs, Cleaning(), "en", "de", one, workers=1, chunk_size=100))
    b = list(clean_pairs(pairs, Cleaning(), "en", "de", two, workers=2, chunk_size=100))
    assert a == b and one.to_dict() == two.to_dict()
    assert a[0] == ('line 0 "quoted"', "Zeile 0")


def test_ordered_map_bounds_in_flight_work():
    seen = []

    def items():
        for i in range(50):
            seen.append(i)
            yield i

    out = ordered_map(abs, items(), workers=1, initializer=lambda: None, initargs=())
    assert next(out) == 0 and len(seen) == 1  # lazy: input read as output is consumed


def test_without_line_breaks():
    assert without_line_breaks("a\rb\u2028c\x85d e") == "a b c d e"
