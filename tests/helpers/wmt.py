"""Builds WMT14-layout fixture archives in a temp folder, and recipe copies that point at them.

The archives have the real member paths (training/europarl-v7.de-en.en, commoncrawl.de-en.en,
training/news-commentary-v9.de-en.en, dev/newstest2013.en, test-full/newstest2014-deen-*.sgm)
so `nmt prep wmt14-en-de --mirror DIR` runs its real code path offline. Training text is
small and made from real sentences (Multi30k) plus a few pairs each cleaning rule must drop;
dev and test are the real newstest2013 text and newstest2014 SGML from ../shared/data.
"""

from __future__ import annotations

import gzip
import hashlib
import io
import re
import tarfile
from pathlib import Path

from conftest import REPO, shared_data_path

# Pairs the cleaner must drop, one per rule (and one it must keep after normalizing).
BAD_PAIRS = [
    ("", "Ein leerer Satz."),  # empty side
    ("word " * 300, "Wort " * 300),  # > 250 words
    ("one two three four five six seven", "eins"),  # ratio 7 > 1.5
]
GOOD_PAIR = ("A man\x07 rides  a «horse» .", "Ein Mann reitet ein Pferd .")


def _add(tar: tarfile.TarFile, name: str, data: bytes) -> None:
    info = tarfile.TarInfo(name)
    info.size = len(data)
    tar.addfile(info, io.BytesIO(data))


def make_tgz(path: Path, members: dict[str, bytes]) -> Path:
    """Write a .tgz holding `members` (name -> bytes) at `path`."""
    with tarfile.open(path, "w:gz") as tar:
        for name, data in members.items():
            _add(tar, name, data)
    return path


def train_text(n: int, offset: int) -> tuple[bytes, bytes]:
    """`n` real Multi30k pairs starting at line `offset`, plus BAD_PAIRS and GOOD_PAIR."""
    m30k = shared_data_path("multi30k")
    en = (m30k / "train.en").read_text("utf-8").split("\n")[offset:offset + n]
    de = (m30k / "train.de").read_text("utf-8").split("\n")[offset:offset + n]
    pairs = list(zip(en, de, strict=True)) + BAD_PAIRS + [GOOD_PAIR]
    return ("".join(s + "\n" for s, _ in pairs).encode(),
            "".join(t + "\n" for _, t in pairs).encode())


def build_wmt14_mirror(root: Path, n_train: int = 200) -> Path:
    """Create root/ with the five WMT14 En-De archives; return root."""
    root.mkdir(parents=True, exist_ok=True)
    wmt = shared_data_path("wmt14")
    for archive, member, offset in (
            ("training-parallel-europarl-v7.tgz", "training/europarl-v7.de-en", 0),
            ("training-parallel-commoncrawl.tgz", "commoncrawl.de-en", n_train),
            ("training-parallel-nc-v9.tgz", "training/news-commentary-v9.de-en", 2 * n_train)):
        en, de = train_text(n_train, offset)
        # Other language pairs sit beside ours in the real archives.
        make_tgz(root / archive, {f"{member}.en": en, f"{member}.de": de,
                                  member.replace("de-en", "fr-en") + ".fr": b"Bonjour.\n"})
    make_tgz(root / "dev.tgz", {"dev/newstest2013.en": (wmt / "newstest2013.en").read_bytes(),
                                "dev/newstest2013.de": (wmt / "newstest2013.de").read_bytes()})
    sgm = wmt / "sgm"
    make_tgz(root / "test-full.tgz", {
        f"test-full/{p.name}": p.read_bytes() for p in sorted(sgm.glob("*.sgm"))})
    return root


def build_multi30k_mirror(root: Path) -> Path:
    """Gzipped copies of ../shared/data/multi30k under their download names."""
    root.mkdir(parents=True, exist_ok=True)
    for path in sorted(shared_data_path("multi30k").iterdir()):
        (root / f"{path.name}.gz").write_bytes(gzip.compress(path.read_bytes()))
    return root


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def recipe_copy(name: str, dest: Path, mirror: Path | None = None,
                replace: dict[str, str] | None = None) -> Path:
    """Copy recipes/NAME.toml to `dest`, pinning each archive to the sha256 of its file in
    `mirror` (instead of the real checksums), then apply text `replace`ments."""
    text = (REPO / "recipes" / f"{name}.toml").read_text("utf-8")
    text = re.sub(r"^(md5|sha256|size|content_sha256) = .*\n", "", text, flags=re.M)
    if mirror is not None:
        def pin(match: re.Match) -> str:
            file = mirror / match.group(2).rsplit("/", 1)[1]
            return f'{match.group(0)}\nsha256 = "{sha256(file)}"' if file.exists() else \
                match.group(0)
        text = re.sub(r'^(url = "(.*)")$', pin, text, flags=re.M)
    for old, new in (replace or {}).items():
        assert old in text, old
        text = text.replace(old, new)
    dest.write_text(text, "utf-8")
    return dest
