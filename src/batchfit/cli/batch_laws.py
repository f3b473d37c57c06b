"""`batchfit batch-size MODEL --train-tokens N`: the global batch and peak LR that published
scaling laws recommend for pre-training (``plan/_batch_laws.py`` computes; this prints)."""

from __future__ import annotations

import re
from typing import Annotated

import typer
from rich.markup import escape

from batchfit._units import human_count
from batchfit.cli.app import JsonO, ModelArg, _emit_json, app
from batchfit.errors import UsageError
from batchfit.plan import BatchAdvice

_TOKENS_RE = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE]\+?[0-9]+)?)\s*([KMBT]?)\s*$", re.IGNORECASE)
_TOKEN_UNITS = {"": 1, "K": 10**3, "M": 10**6, "B": 10**9, "T": 10**12}
MAX_TOKENS = 10**18  # a quintillion tokens: past any corpus, and far past every fit


def parse_tokens(text: str) -> int:
    """A token count: ``2T``, ``100B``, ``2e12`` or ``1000000``.

    Example:
        >>> parse_tokens("2T"), parse_tokens("1.5B"), parse_tokens("2e9")
        (2000000000000, 1500000000, 2000000000)
    """
    match = _TOKENS_RE.match(text)
    if not match:
        raise UsageError(
            f"--train-tokens {text!r} is not a positive token count such as 2T, 100B or 2e12"
        )
    value = float(match.group(1)) * _TOKEN_UNITS[match.group(2).upper()]
    if not 1 <= value <= MAX_TOKENS:  # 1e400 is inf: no int of it
        raise UsageError(f"--train-tokens {text!r} must be between 1 and 1e18 tokens")
    count = int(value)
    if not 1 <= count <= MAX_TOKENS:
        raise UsageError(f"--train-tokens {text!r} must be between 1 and 1e18 tokens")
    return count


@app.command("batch-size")
def batch_size(
    model: ModelArg,
    train_tokens: Annotated[
        str,
        typer.Option(
            "--train-tokens",
            help="Tokens of the whole pre-training run (2T, 100B, 2e12).",
            show_default=False,
        ),
    ],
    seq_len: Annotated[
        int,
        typer.Option(
            "--seq-len",
            "-s",
            help="Tokens per sample: attention's share of the FLOPs per token, and the "
            "suggested batch in samples.",
        ),
    ] = 4096,
    as_json: JsonO = False,
) -> None:
    """The global batch and peak LR that published scaling laws give for pre-training.

    DeepSeek LLM (arXiv:2401.02954) from the compute C = M x D, Step Law (arXiv:2503.04715)
    from the tokens D and the non-embedding parameters N; the range where they disagree, and
    a warning outside the grid each was fitted on.
    """
    from batchfit.models import resolve_model
    from batchfit.plan import model_batch_laws

    tokens = parse_tokens(train_tokens)
    if seq_len < 1:
        raise UsageError(f"--seq-len must be positive, got {seq_len}")
    info = resolve_model(model)
    advice = model_batch_laws(info, tokens, seq_len)
    if as_json:
        _emit_json(advice.to_json())
        return
    _render(advice)


def _render(a: BatchAdvice) -> None:
    from batchfit.cli.render import err, out

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
    for w in a.warnings:
        err.print(f"[yellow]warning:[/] {escape(w)}")
