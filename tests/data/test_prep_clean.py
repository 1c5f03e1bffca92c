"""Cleaning rules, their counts, and the order-keeping multi-process map."""

from __future__ import annotations

import numpy as np

from nmt.data.clean import Counts, PairCleaner, clean_pairs, ordered_map, without_line_breaks
from nmt.data.dedup import DigestSet, pair_digest
from nmt.data.recipes import Cleaning


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
                                "after_max_words": 3, "after_max_ratio": 2,
                                "after_overlap": 2, "after_dedup": 2, "output": 2}


def test_overlap_with_dev_and_test_sources_and_duplicates_are_dropped():
    rules = Cleaning(max_ratio=0)
    cleaner = PairCleaner(rules, "en", "de")
    # Dev/test sources as published: normalized with the training rules before comparing.
    held_out = frozenset(cleaner.normalize(s, 0) for s in ["A „test“ sentence .",
                                                           "Another one ."])
    pairs = [("A \"test\" sentence .", "Ein Testsatz ."),  # its source is a test source
             ("A dog runs .", "Ein Hund rennt ."),
             ("A  dog runs .", "Ein Hund rennt ."),  # duplicate once whitespace is collapsed
             ("A dog runs .", "Ein Hund läuft ."),  # same source, other target: kept
             ("A dog runs .", "Ein Hund rennt .")]  # duplicate
    seen = DigestSet()
    counts = Counts()
    kept = list(clean_pairs(pairs, rules, "en", "de", counts, held_out=held_out, seen=seen))
    assert kept == [("A dog runs .", "Ein Hund rennt ."), ("A dog runs .", "Ein Hund läuft .")]
    assert counts.to_dict()["after_max_ratio"] == 5
    assert counts.to_dict()["after_overlap"] == 4 and counts.output == 2
    # The same set carries over to the next corpus: its copy of a kept pair is dropped.
    more = Counts()
    assert list(clean_pairs([("A dog runs .", "Ein Hund läuft ."), ("New .", "Neu .")],
                            rules, "en", "de", more, seen=seen)) == [("New .", "Neu .")]
    assert more.after["dedup"] == 1 and more.after["overlap"] == 2
    # Both rules can be switched off.
    off = Cleaning(max_ratio=0, dedup=False, remove_overlap=False)
    assert len(list(clean_pairs(pairs, off, "en", "de", Counts(), held_out=held_out))) == 5


def test_digest_set_matches_a_python_set():
    rng = np.random.default_rng(1)
    values = rng.integers(0, 1 << 20, size=20000, dtype=np.uint64)  # many repeats, and 0
    digests, reference = DigestSet(capacity=16), set()
    for start in range(0, len(values), 777):  # grows through several doublings
        batch = values[start:start + 777]
        expected = []
        for v in batch.tolist():
            expected.append(max(v, 1) not in reference)
            reference.add(max(v, 1))
        assert digests.add_new(batch).tolist() == expected
    assert len(digests) == len(reference)
    assert pair_digest("a b", "c") != pair_digest("a", "b c")


def test_two_workers_keep_order_and_match_one_worker():
    # Pairs 2000.. repeat pairs 0..999 (dedup across chunks handled by other processes).
    pairs = [(f"line {i % 2000} „quoted“", f"Zeile {i % 2000}" + " x" * (i % 4))
             for i in range(3000)]
    one, two = Counts(), Counts()
    a = list(clean_pairs(pairs, Cleaning(), "en", "de", one, workers=1, chunk_size=100))
    b = list(clean_pairs(pairs, Cleaning(), "en", "de", two, workers=2, chunk_size=100))
    assert a == b and one.to_dict() == two.to_dict()
    assert one.after["max_ratio"] - one.output == 1000 * 3 // 4  # ratio-kept duplicates
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


# Real lines (Multi30k train.en 16217 and 18422, train.de, newstest2013.de) and the output of
# Moses' normalize-punctuation.perl (mosesdecoder master, run as `-l LANG`) on them.
PERL_OUTPUT = [
    ("en", "A man and a woman on a motorcycle .`", "A man and a woman on a motorcycle .'"),
    ("en", "A women` s hand and arm with blue fingernail polish and a tattoo that reads no "
     "regrets.", "A women' s hand and arm with blue fingernail polish and a tattoo that "
     "reads no regrets."),
    ("en", "He said ''no'' to me.", 'He said " no " to me.'),  # Penn-style quotes
    ("de", "Ein Mann und eine Frau halten ein Schild mit der Aufschrift: „It's a nice day",
     "Ein Mann und eine Frau halten ein Schild mit der Aufschrift: \"It's a nice day"),
]


def test_punctuation_matches_the_perl_script_with_its_default_penn_rules():
    for lang, raw, perl in PERL_OUTPUT:
        cleaner = PairCleaner(Cleaning(), lang, lang)
        assert cleaner.normalize(raw, 0) == perl, raw


def test_punctuation_departs_from_the_perl_script_only_where_documented():
    de = PairCleaner(Cleaning(), "de", "de")
    # perl: '"Hook "em Horns"-Zeichen.' (a right single quote outside a word becomes ")
    assert de.normalize("Ein Mann mit gelber Krawatte und Hemd macht das „Hook ’em Horns“-"
                        "Zeichen. ", 0) == \
        "Ein Mann mit gelber Krawatte und Hemd macht das \"Hook 'em Horns\"-Zeichen."
    # perl: '... zu Krebs".' (the sentence-final period moves outside the quote)
    line = '"Die Durchführung eines Früherkennungstest führt nicht zu Krebs."'
    assert de.normalize(line, 0) == line
