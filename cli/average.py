"""`nmt average`: not built yet."""

from __future__ import annotations

from cli.common import not_built


def command() -> None:
    """Not built yet."""
    not_built("average", "its issue")
