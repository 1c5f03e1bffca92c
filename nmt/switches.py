"""Every NMT_* environment variable the library reads, listed here and read when used.

Settings a user chooses are flags and config fields (nmt/config.py). These switches are
for comparisons, debugging and tests: each turns one implementation choice off or forces
it, and none changes what a model computes beyond float rounding. Read at the moment of
use (never cached at import), so a test or a bench may set one and see it take effect.
`nmt prep`'s NMT_MIRROR is its `--mirror` flag's environment form (cli/prep.py).
"""

from __future__ import annotations

import os
from typing import NamedTuple


class Switch(NamedTuple):
    """One environment switch: its name, the value it has when unset, and what it does."""

    name: str
    default: str
    effect: str


SWITCHES: dict[str, Switch] = {s.name: s for s in (
    Switch("NMT_KERNELS", "1", "0 runs PyTorch's ops in place of every one of nmt's C kernels "
           "(nmt/kernels)"),
    Switch("NMT_CHECK_LAYOUT", "0", "1 verifies every reorder layout the search promises the "
           "key/value cache, at two host reads a reorder (nmt/inference/kv_cache.py)"),
    Switch("NMT_HUGE_PAGE_HEAP", "1", "0 keeps `nmt train`'s heap in 4 KiB pages instead of "
           "re-executing it with glibc's heap in transparent huge pages "
           "(nmt/host_memory.py)"),
    Switch("NMT_SHORTLIST_REST", "1", "0 normalises a shortlist's log-probabilities over "
           "its candidates alone (as Marian and CTranslate2 do) instead of counting the "
           "estimated mass of the pieces it leaves out (nmt/inference/rest_mass.py)"),
)}


def switch(name: str) -> str:
    """The value of the switch `name` now (its default when unset); KeyError for a name
    not listed in SWITCHES."""
    return os.environ.get(name, SWITCHES[name].default)
