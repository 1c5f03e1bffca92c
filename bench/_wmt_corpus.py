"""WMT14 En-De's five archives at real size, made from real sentences, for the rehearsal.

bench/wmt_rehearsal.py needs what `nmt prep wmt14-en-de` downloads, without the network:
the archives of recipes/wmt14-en-de.toml with their real names, layouts and member names
(a few decoy members each, as the real ones hold other language pairs), and a copy of the
recipe whose sizes and sha256s are those of the built files, so prep's verification runs.

Training text: Multi30k's 29,000 real pairs (../shared/data/multi30k), recombined. A
training line joins k segments, each a whole Multi30k pair or its first halves (k drawn so
that lines average about 23 words, with a 0.2 % tail past 250 words), which keeps 4.5M
lines distinct. Planted on purpose, so that every cleaning rule has work: exact repeats of
earlier pairs (dedup), pairs whose target has two segments more (ratio), sources copied
from newstest2013/2014 (dev/test overlap), and the tail (max_words). Dev and test are the
real newstest2013 (plain text) and newstest2014 (the SGML of test-full.tgz).
"""

from __future__ import annotations

import gzip
import io
import re
import tarfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from nmt.fileio import sha256_file

# The training corpora of the recipe: archive file, member of each side, and the share of
# WMT14's 4,520,620 pairs each holds (Europarl v7 1,920,209; CommonCrawl 2,399,123; News
# Commentary v9 201,288).
CORPORA = {
    "europarl": ("training-parallel-europarl-v7.tgz", "training/europarl-v7.de-en",
                 1_920_209 / 4_520_620),
    "commoncrawl": ("training-parallel-commoncrawl.tgz", "commoncrawl.de-en",
                    2_399_123 / 4_520_620),
    "news-commentary": ("training-parallel-nc-v9.tgz", "training/news-commentary-v9.de-en",
                        201_288 / 4_520_620),
}
DEV_ARCHIVE, TEST_ARCHIVE = "dev.tgz", "test-full.tgz"
# Segments per training line and their probabilities: mean 2.43 segments of 9.6 words.
K_VALUES = np.array([1, 2, 3, 4, 5, 6, 7, 8])
K_PROBS = np.array([0.02, 0.72, 0.18, 0.05, 0.012, 0.008, 0.005, 0.005])
HALF_SEGMENT = 0.4  # a segment is the first halves of a pair this often
TAIL = 0.002  # lines of 28-40 segments (about 270-380 words): max_words drops them
REPEAT = 0.005  # exact repeats of an earlier pair: dedup drops them
RATIO = 0.01  # two more segments on the target side: most fail the 1.5 ratio rule
OVERLAP = 0.0005  # the source is a newstest2013/2014 source: the overlap rule drops them


@dataclass
class Built:
    """What was built: pairs per corpus, the planted pairs by rule, bytes, seconds."""

    pairs: dict[str, int] = field(default_factory=dict)
    planted: dict[str, int] = field(default_factory=lambda: dict.fromkeys(
        ("tail", "repeat", "ratio", "overlap"), 0))
    text_bytes: int = 0
    archive_bytes: int = 0
    seconds: float = 0.0

    def to_dict(self) -> dict[str, object]:
        """Plain dict for a record's figures."""
        return asdict(self)


def _read(path: Path) -> list[str]:
    return path.read_text(encoding="utf-8").split("\n")[:-1]


def _halves(lines: list[str]) -> list[str]:
    """Each line's first half of its words (at least one)."""
    out = []
    for line in lines:
        words = line.split()
        out.append(" ".join(words[: max(1, (len(words) + 1) // 2)]))
    return out


class _Lines:
    """Draws training pairs from the segment pool with one seeded generator."""

    def __init__(self, shared: Path, seed: int) -> None:
        src, tgt = _read(shared / "multi30k/train.en"), _read(shared / "multi30k/train.de")
        self.src, self.tgt = src + _halves(src), tgt + _halves(tgt)  # (2 x 29,000,)
        self.full = len(src)
        self.held_out = _read(shared / "wmt14/newstest2013.en") + \
            _read(shared / "wmt14/newstest2014.en")
        self.rng = np.random.default_rng(seed)

    def _segments(self, n: int) -> np.ndarray:
        """Indices of `n` segments: whole pairs, or with HALF_SEGMENT their halves."""
        index = self.rng.integers(0, self.full, n)  # (n,)
        return index + self.full * (self.rng.random(n) < HALF_SEGMENT)

    def corpus(self, n: int, built: Built) -> tuple[list[str], list[str]]:
        """`n` line pairs with the planted cases mixed in at random positions."""
        rng = self.rng
        k = rng.choice(K_VALUES, size=n, p=K_PROBS)  # (n,) segments per line
        tail = rng.random(n) < TAIL
        k[tail] = rng.integers(28, 41, int(tail.sum()))
        starts = np.concatenate([[0], np.cumsum(k)])  # (n + 1,)
        segments = self._segments(int(starts[-1])).tolist()
        kind = rng.random(n)  # which planted case a line is, if any
        extra = self._segments(2 * n).tolist()  # the ratio cases' two more target segments
        src_pool, tgt_pool = self.src, self.tgt
        src_lines, tgt_lines = [], []
        for i in range(n):
            picked = segments[starts[i]:starts[i + 1]]
            src = " ".join([src_pool[j] for j in picked])
            tgt = " ".join([tgt_pool[j] for j in picked])
            case = kind[i]
            if case < REPEAT and i:
                j = int(rng.integers(0, i))
                src, tgt = src_lines[j], tgt_lines[j]
                built.planted["repeat"] += 1
            elif case < REPEAT + RATIO:
                tgt = " ".join([tgt, tgt_pool[extra[2 * i]], tgt_pool[extra[2 * i + 1]]])
                built.planted["ratio"] += 1
            elif case < REPEAT + RATIO + OVERLAP:
                src = self.held_out[int(rng.integers(0, len(self.held_out)))]
                built.planted["overlap"] += 1
            elif tail[i]:
                built.planted["tail"] += 1
            src_lines.append(src)
            tgt_lines.append(tgt)
        return src_lines, tgt_lines


def _text(lines: list[str]) -> bytes:
    return "".join(line + "\n" for line in lines).encode("utf-8")


def _add(tar: tarfile.TarFile, name: str, data: bytes) -> None:
    info = tarfile.TarInfo(name)
    info.size, info.mtime, info.mode = len(data), 1388534400, 0o644  # 2014-01-01
    tar.addfile(info, io.BytesIO(data))


def _write_tgz(path: Path, members: list[tuple[str, bytes]]) -> None:
    """A gzipped tar of `members` (level 1: the archive's speed is not what is measured),
    written to a temp name and renamed."""
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as raw, gzip.GzipFile(fileobj=raw, mode="wb", compresslevel=1,
                                               mtime=0) as gz, \
            tarfile.open(fileobj=gz, mode="w|") as tar:
        for name, data in members:
            _add(tar, name, data)
    tmp.rename(path)


def build_archives(out: Path, pairs: int, shared: Path, seed: int = 1) -> Built:
    """Write the recipe's five archives under `out` with `pairs` training pairs in all."""
    start = time.perf_counter()
    out.mkdir(parents=True, exist_ok=True)
    built = Built()
    lines = _Lines(shared, seed)
    decoy = _text(lines.src[:500])  # another language pair's member, skipped by prep
    names = list(CORPORA)
    sizes = [round(pairs * CORPORA[c][2]) for c in names]
    sizes[-1] = pairs - sum(sizes[:-1])
    for name, size in zip(names, sizes, strict=True):
        archive, stem, _ = CORPORA[name]
        src, tgt = lines.corpus(size, built)
        src_bytes, tgt_bytes = _text(src), _text(tgt)
        del src, tgt
        decoy_stem = stem.replace("de-en", "fr-en")
        _write_tgz(out / archive, [(f"{decoy_stem}.en", decoy), (f"{decoy_stem}.fr", decoy),
                                   (f"{stem}.de", tgt_bytes), (f"{stem}.en", src_bytes)])
        built.pairs[name] = size
        built.text_bytes += len(src_bytes) + len(tgt_bytes)
    dev = shared / "wmt14"
    _write_tgz(out / DEV_ARCHIVE, [
        ("dev/newstest2012.en", decoy), ("dev/newstest2013.de", (dev / "newstest2013.de")
                                         .read_bytes()),
        ("dev/newstest2013.en", (dev / "newstest2013.en").read_bytes())])
    sgm = dev / "sgm"
    _write_tgz(out / TEST_ARCHIVE, [
        (f"test-full/{p.name}", p.read_bytes()) for p in sorted(sgm.glob("*.sgm"))])
    built.archive_bytes = sum(p.stat().st_size for p in out.glob("*.tgz"))
    built.seconds = time.perf_counter() - start
    return built


def write_recipe(recipe: Path, archives: Path, dest: Path) -> Path:
    """A copy of `recipe` whose every archive carries the size and sha256 of its file in
    `archives` (found by the URL's file name, as --mirror finds it) in place of the real
    archives' checks; returns `dest`."""
    text = re.sub(r"^(md5|sha256|size|content_sha256) = .*\n", "",
                  recipe.read_text(encoding="utf-8"), flags=re.M)

    def pin(match: re.Match) -> str:
        file = archives / match.group(2).rsplit("/", 1)[1]
        return f'{match.group(0)}\nsize = {file.stat().st_size}\nsha256 = "{sha256_file(file)}"'

    dest.write_text(re.sub(r'^(url = "(.*)")$', pin, text, flags=re.M), encoding="utf-8")
    return dest
