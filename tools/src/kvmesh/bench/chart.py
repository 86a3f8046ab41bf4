"""Bar charts as PNG: matplotlib when the ``bench`` extra is installed, else a tiny pure-Python writer."""

from __future__ import annotations

import struct
import zlib
from collections.abc import Sequence
from pathlib import Path

__all__ = ["write_bar_charts", "write_png"]

_COLORS = [(31, 119, 180), (255, 127, 14), (44, 160, 44), (214, 39, 40), (148, 103, 189), (140, 86, 75)]


def write_png(path: Path, pixels: Sequence[Sequence[tuple[int, int, int]]]) -> None:
    """Write an RGB image (rows of ``(r, g, b)``) as a PNG file with zlib and struct only."""
    height, width = len(pixels), len(pixels[0])
    raw = b"".join(b"\x00" + bytes(c for px in row for c in px) for row in pixels)

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    path.write_bytes(
        b"\x89PNG\r\n\x1a\n"
        + chunk(b"IHDR", header)
        + chunk(b"IDAT", zlib.compress(raw, 9))
        + chunk(b"IEND", b"")
    )


def write_bar_charts(
    path: Path, title: str, labels: Sequence[str], panels: Sequence[tuple[str, Sequence[float]]]
) -> str:
    """Write one bar chart per panel (``(name, one value per label)``) side by side; return the backend used.

    Without matplotlib the fallback has no text: bars keep the label order and colours of the table.
    """
    try:
        import matplotlib  # noqa: PLC0415 - optional dependency (bench extra)

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt  # noqa: PLC0415
    except ImportError:
        _write_plain(path, labels, panels)
        return "plain"
    fig, axes = plt.subplots(1, len(panels), figsize=(4.2 * len(panels), 3.8))
    axes = list(axes) if len(panels) > 1 else [axes]
    colors = [tuple(c / 255 for c in _COLORS[i % len(_COLORS)]) for i in range(len(labels))]
    for ax, (name, values) in zip(axes, panels, strict=True):
        bars = ax.bar(range(len(labels)), values, color=colors)
        ax.set_xticks(range(len(labels)), labels, rotation=30, ha="right", fontsize=8)
        ax.set_title(name, fontsize=10)
        for bar, v in zip(bars, values, strict=True):
            ax.annotate(
                f"{v:.3g}",
                (bar.get_x() + bar.get_width() / 2, bar.get_height()),
                ha="center",
                va="bottom",
                fontsize=7,
            )
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return "matplotlib"


def _write_plain(path: Path, labels: Sequence[str], panels: Sequence[tuple[str, Sequence[float]]]) -> None:
    bar_w, gap, height, margin = 18, 6, 160, 10
    panel_w = len(labels) * (bar_w + gap) + 2 * margin
    width = panel_w * len(panels)
    img = [[(255, 255, 255)] * width for _ in range(height + 2 * margin)]
    for p, (_name, values) in enumerate(panels):
        top = max(values) or 1.0
        for i, v in enumerate(values):
            h = int(height * max(0.0, v) / top)
            x0 = p * panel_w + margin + i * (bar_w + gap)
            for y in range(margin + height - h, margin + height):
                img[y][x0 : x0 + bar_w] = [_COLORS[i % len(_COLORS)]] * bar_w
        for y in range(len(img)):
            img[y][p * panel_w] = (200, 200, 200)
    write_png(path, img)
