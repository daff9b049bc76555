"""Draw docs/img/swizzle_128x4.png: where each compact E8M0 scale lands in one 512-byte 128x4 swizzle tile.

Positions are computed with :func:`mxport.layouts.swizzle` itself (not re-derived from the formula): the
compact grid is swizzled twice, once carrying ``row + 1`` and once carrying ``col + 1`` in its bytes, so each
swizzled byte names the compact entry it holds (0 = padding).

Usage: ``.venv/bin/python scripts/make_swizzle_figure.py [OUT.png]`` (default ``docs/img/swizzle_128x4.png``).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch

from mxport.bench.report import save_figure
from mxport.layouts import swizzle

DEFAULT_OUT = Path(__file__).resolve().parents[1] / "docs" / "img" / "swizzle_128x4.png"


def tile_sources(rows: int = 128, cols: int = 4) -> tuple[torch.Tensor, torch.Tensor]:
    """The swizzled bytes' source row and column, for a compact ``(rows, cols)`` grid.

    ``rows`` and ``cols`` are at most 255.

    Returns two int64 tensors shaped like ``swizzle``'s output viewed as 16-byte lines, ``(-1, 16)``; entry =
    the compact row / column whose scale sits at that byte, or -1 for a padding byte.
    """
    if not (0 < rows <= 255 and 0 < cols <= 255):
        raise ValueError(f"rows and cols must be in 1..255, got ({rows}, {cols})")
    r = torch.arange(1, rows + 1, dtype=torch.uint8).unsqueeze(1).expand(rows, cols).contiguous()
    c = torch.arange(1, cols + 1, dtype=torch.uint8).unsqueeze(0).expand(rows, cols).contiguous()
    src_r = swizzle(r).reshape(-1, 16).to(torch.int64) - 1
    src_c = swizzle(c).reshape(-1, 16).to(torch.int64) - 1
    return src_r, src_c


def draw(out: str | os.PathLike = DEFAULT_OUT) -> Path:
    """Render the figure (matplotlib, Agg) and write it atomically to ``out``; return the path."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.colors import ListedColormap

    src_r, src_c = tile_sources(128, 4)
    colors = ListedColormap(["#4e79a7", "#f28e2b", "#59a14f", "#e15759"])
    fig, (ax_l, ax_r) = plt.subplots(1, 2, figsize=(13, 8.5), gridspec_kw={"width_ratios": [1, 3.2]}, dpi=110)

    # left: the compact 128 x 4 grid (rows = M, columns = K blocks), colour = column
    grid_c = torch.arange(4).expand(128, 4)
    ax_l.imshow(grid_c.numpy(), cmap=colors, aspect="auto", interpolation="nearest")
    for y in (31.5, 63.5, 95.5):
        ax_l.axhline(y, color="black", lw=1.5)
    for rr in range(0, 128, 8):
        for cc in range(4):
            ax_l.text(cc, rr, f"{rr},{cc}", ha="center", va="center", fontsize=5, color="white")
    ax_l.set_title("compact scales (r, c): 128 rows x 4 blocks", fontsize=10)
    ax_l.set_xlabel("c (block along K)")
    ax_l.set_ylabel("r (row)")
    ax_l.set_xticks(range(4))

    # right: the 512-byte tile as 32 lines of 16 bytes; label = source row, colour = source column
    ax_r.imshow(src_c.numpy(), cmap=colors, aspect="auto", interpolation="nearest")
    for line in range(src_r.shape[0]):
        for b in range(16):
            ax_r.text(b, line, str(int(src_r[line, b])), ha="center", va="center", fontsize=6, color="white")
    for x in (3.5, 7.5, 11.5):
        ax_r.axvline(x, color="black", lw=1.5)
    ax_r.set_xticks(range(16))
    ax_r.set_xlabel("byte within the 16-byte line = ((r % 128) // 32) * 4 + c % 4")
    ax_r.set_ylabel("line = r % 32")
    ax_r.set_title("swizzled tile (512 bytes, row-major): number = source row r, colour = source column c",
                   fontsize=10)
    fig.suptitle("cuBLAS VEC32_UE8M0 / FlashInfer layout_128x4 swizzle, computed with "
                 "mxport.layouts.swizzle\n"
                 "byte = ((r // 128) * ceil(C / 4) + c // 4) * 512 + (r % 32) * 16 "
                 "+ ((r % 128) // 32) * 4 + c % 4",
                 fontsize=11)
    fig.tight_layout()

    return save_figure(fig, out)


if __name__ == "__main__":
    print(draw(sys.argv[1] if len(sys.argv) > 1 else DEFAULT_OUT))
