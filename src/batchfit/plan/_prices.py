"""The GPU-hour price a plan's cost uses: ``--gpu-hour-price``, else the catalog's default table
(``catalog/prices.json``: approximate on-demand list prices, each with its source and the date
they were read)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import cache

from batchfit import catalog
from batchfit.errors import UsageError


@dataclass(frozen=True)
class GpuHourPrice:
    """Dollars per GPU-hour and where the figure comes from."""

    usd: float
    source: str  # "--gpu-hour-price", or the table's provider, list and date

    @property
    def label(self) -> str:
        """``$3.78/GPU-hour (source)``, as the plan prints it."""
        return f"${self.usd:g}/GPU-hour ({self.source})"


@cache
def price_table() -> dict[str, GpuHourPrice]:
    """The default table by catalog GPU name; each source ends with the table's date.

    Example:
        >>> price_table()["t4"].usd
        0.5904
        >>> price_table()["t4"].source  # doctest: +ELLIPSIS
        'Modal list, T4 at $0.000164/s, https://modal.com/pricing; approximate, as of 2026-05-07'
    """
    data = catalog.load("prices")
    when = f"approximate, as of {data['as_of']}"
    return {
        row["gpu"]: GpuHourPrice(float(row["usd_per_gpu_hour"]), f"{row['source']}; {when}")
        for row in data["prices"]
    }


def gpu_hour_price(given: float | None, gpu: str) -> GpuHourPrice | None:
    """``given`` (``--gpu-hour-price``) when there is one, else the table's price for ``gpu``
    (None: no price, no cost).

    Raises:
        UsageError: ``given`` is not a positive number of dollars.

    Example:
        >>> gpu_hour_price(2.5, "t4").label
        '$2.5/GPU-hour (--gpu-hour-price)'
        >>> gpu_hour_price(None, "rtx-3060") is None  # no confident list price
        True
    """
    if given is not None:
        if isinstance(given, bool) or not (math.isfinite(given) and given > 0):
            raise UsageError(f"--gpu-hour-price must be a positive number of dollars, got {given}")
        return GpuHourPrice(float(given), "--gpu-hour-price")
    return price_table().get(gpu)
