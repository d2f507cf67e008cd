"""What every plot of a run, a sweep or a reproduction shares: a figure drawn off-screen and saved as PNG."""

from __future__ import annotations

import io
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any


@contextmanager
def figure(**subplots) -> Iterator[tuple[Any, Any]]:
    """``plt.subplots(**subplots)``, drawn with Agg (no display on a server or in a Ray worker) and closed
    when the block ends, so that figures do not pile up in a long-lived process."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(**subplots)
    try:
        yield fig, axes
    finally:
        plt.close(fig)


def png(fig, dpi: float | None = None) -> bytes:
    """The figure, laid out tightly, as PNG bytes (``dpi`` None: the figure's own)."""
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=dpi)
    return buf.getvalue()


def round_axis(ax) -> None:
    from matplotlib.ticker import MaxNLocator

    ax.set_xlabel("round")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))  # no half-round ticks
