"""This CPU: how many cores this process may use (the default for every worker or thread
count) and what /proc/cpuinfo says it is (the kernels and measurements that depend on it)."""

from __future__ import annotations

import functools
import os


def available_cores() -> int:
    """Cores this process may run on (respects taskset/cgroup affinity where the OS tells)."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # not Linux
        return max(1, os.cpu_count() or 1)


@functools.cache
def cpu_info() -> dict[str, str]:
    """The first core's "vendor_id", "model name" and "flags" lines of /proc/cpuinfo, values
    only (empty where it cannot be read: not Linux)."""
    info: dict[str, str] = {}
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as lines:
            for line in lines:
                key, _, value = line.partition(":")
                key = key.strip()
                if key in ("vendor_id", "model name", "flags") and key not in info:
                    info[key] = value.strip()
                if len(info) == 3:
                    break
    except OSError:
        pass
    return info
