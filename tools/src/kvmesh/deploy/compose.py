"""Placeholder: filled in by the deployment work."""

from __future__ import annotations

import sys
from collections.abc import Sequence


def command(argv: Sequence[str] | None = None, prog: str = "kvmesh") -> int:
    """Not implemented yet."""
    print(f"{prog}: not implemented yet", file=sys.stderr)
    return 2
