"""``batchfit batch-size MODEL --train-tokens N``: the global batch and peak LR that published
scaling laws recommend for pre-training (``plan/_batch_laws.py`` computes, ``render.batch_size``
prints); and the token counts ``--train-tokens`` takes, here and in ``plan``."""

from __future__ import annotations

import re
from typing import Annotated

import typer

from batchfit import models
from batchfit.cli.common import _emit_json
from batchfit.cli.options import JsonO, ModelArg
from batchfit.errors import UsageError
from batchfit.plan import model_batch_laws

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


TrainTokensArg = Annotated[
    str,
    typer.Option(
        "--train-tokens",
        help="Tokens of the whole pre-training run (2T, 100B, 2e12).",
        show_default=False,
    ),
]
SeqLenO = Annotated[
    int,
    typer.Option(
        "--seq-len",
        "-s",
        help="Tokens per sample: attention's share of the FLOPs per token, and the "
        "suggested batch in samples.",
    ),
]


def batch_size(
    model: ModelArg, train_tokens: TrainTokensArg, seq_len: SeqLenO = 4096, as_json: JsonO = False
) -> None:
    """The global batch and peak LR that published scaling laws give for pre-training.

    DeepSeek LLM (arXiv:2401.02954) from the compute C = M x D, Step Law (arXiv:2503.04715)
    from the tokens D and the non-embedding parameters N; the range where they disagree, and
    a warning outside the grid each was fitted on.
    """
    # rich loads when the answer is printed, not for `batchfit --help`
    from batchfit.cli.render.batch_size import batch_advice

    tokens = parse_tokens(train_tokens)
    if seq_len < 1:
        raise UsageError(f"--seq-len must be positive, got {seq_len}")
    info = models.resolve_model(model)  # on its module: a test may stand in for it
    advice = model_batch_laws(info, tokens, seq_len)
    if as_json:
        _emit_json(advice.to_json())
        return
    batch_advice(advice)
