"""Rendering of ``batchfit batch-size``: each scaling law's batch and LR, their range, and the
suggestion."""

from __future__ import annotations

from rich.markup import escape

from batchfit._units import human_count
from batchfit.cli import render
from batchfit.plan import BatchAdvice


def batch_advice(a: BatchAdvice) -> None:
    out = render.out
    out.print(
        f"[bold]{escape(a.model)}[/]: N = {human_count(a.non_embedding_params)} non-embedding "
        f"parameters, M = {a.flops_per_token:.3g} FLOPs/token at seq {a.seq_len}, "
        f"D = {human_count(a.train_tokens)} tokens, C = M x D = {a.compute_flops:.3g} FLOPs"
    )
    for law in a.answers:
        where = "inside its fit" if law.inside_fit else "[yellow]extrapolated[/]"
        out.print(
            f"  {law.name}: global batch [bold]{human_count(law.batch_tokens)}[/] tokens "
            f"({law.batch_tokens / a.seq_len:,.0f} x {a.seq_len}), peak LR "
            f"[bold]{law.learning_rate:.3g}[/] ({where}; {escape(law.source)})"
        )
    lo, hi = a.batch_tokens_range
    lr_lo, lr_hi = a.learning_rate_range
    out.print(
        f"  range: batch {human_count(lo)} to {human_count(hi)} tokens, LR {lr_lo:.3g} to "
        f"{lr_hi:.3g}"
    )
    samples = a.suggested_batch_tokens // a.seq_len
    out.print(
        f"  suggested: --global-batch-tokens {a.suggested_batch_tokens} ({samples} x "
        f"{a.seq_len}, a power of two near the laws' geometric mean), peak LR "
        f"{a.suggested_learning_rate:.3g} (AdamW; tune around it)"
    )
    render.warn(a.warnings)
