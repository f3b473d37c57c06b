"""One style for every picture batchfit draws (the probe's plot, the monitor's, the timeline):
matplotlib's non-interactive backend, type readable at 100% zoom, GiB and seconds.

matplotlib is the ``plot`` extra: :func:`require` refuses a plot option before any work runs.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from batchfit._units import BYTES_IN_GIB
from batchfit.errors import UsageError

STYLE: dict[str, Any] = {
    "font.size": 11,
    "axes.titlesize": 11,
    "axes.labelsize": 11,
    "legend.fontsize": 10,
    "axes.grid": True,
    "grid.alpha": 0.3,
    "figure.dpi": 100,
}


def require(option: str = "--plot") -> None:
    """Refuse ``option`` without matplotlib, before the work it would draw runs."""
    try:
        # lazy: matplotlib (~0.5 s, optional) only when a picture is drawn
        import matplotlib  # noqa: F401
    except ImportError:
        raise UsageError(f"{option} needs matplotlib: pip install 'batchfit[plot]'") from None


def pyplot() -> Any:
    """matplotlib.pyplot on the Agg backend, with the house style applied."""
    require()
    # lazy: matplotlib (~0.5 s, optional) only when a picture is drawn
    import matplotlib

    matplotlib.use("Agg")
    # lazy: matplotlib (~0.5 s, optional) only when a picture is drawn
    import matplotlib.pyplot as plt

    rc: Any = plt.rcParams  # typed by literal keys; STYLE's are among them
    rc.update(STYLE)
    return plt


def gib(num_bytes: float) -> float:
    return num_bytes / BYTES_IN_GIB


def save(fig: Any, path: Path, option: str = "--plot") -> None:
    """Write ``fig`` to ``path`` through a temporary name (an interrupted write leaves no half
    file); close it whatever happens."""
    # lazy: matplotlib (~0.5 s, optional) only when a picture is drawn
    import matplotlib.pyplot as plt

    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        fig.tight_layout()
        fig.savefig(tmp, dpi=100, format=path.suffix.lstrip(".") or "png")
        os.replace(tmp, path)
    except OSError as e:
        raise UsageError(f"cannot write {option} {path}: {e.strerror}") from None
    finally:
        plt.close(fig)
        if tmp.exists():
            tmp.unlink()
