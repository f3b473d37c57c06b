"""The analytic engine's entry, kept at this path; it lives in ``batchfit.memory.formulas``."""

from batchfit.memory.formulas.analytic import estimate_analytic, resolve_setup

__all__ = ["estimate_analytic", "resolve_setup"]
