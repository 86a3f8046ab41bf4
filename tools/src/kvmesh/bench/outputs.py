"""Where a benchmark writes its results: ``--out PREFIX`` checked before the run, not after it."""

from __future__ import annotations

import argparse
from pathlib import Path


def out_prefix(value: str) -> str:
    """An argparse ``type`` for ``--out PREFIX``: creates PREFIX's folder now, so a benchmark that runs for
    minutes does not fail at its end on a folder that is missing.

    Raises:
        argparse.ArgumentTypeError: the folder cannot be created (the message names it and why).
    """
    folder = Path(value).parent
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise argparse.ArgumentTypeError(
            f"cannot create the folder {str(folder)!r}: {exc.strerror}"
        ) from None
    return value
