"""How many CPU cores this process may use: the default for every worker or thread count."""

from __future__ import annotations

import os


def available_cores() -> int:
    """Cores this process may run on (respects taskset/cgroup affinity where the OS tells)."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # not Linux
        return max(1, os.cpu_count() or 1)
