"""One sample's size from the options: tokens (``--seq-len``, ``--lengths``) or pixels
(``--image-size``), checked against the model before anything runs."""

from __future__ import annotations

from typing import TYPE_CHECKING, Annotated

import typer

from batchfit.errors import UsageError
from batchfit.lengths import LengthsSummary, first_longer, workload

if TYPE_CHECKING:
    from batchfit.models import ModelInfo

ImageSizeO = Annotated[
    int | None,
    typer.Option(
        "--image-size",
        help="Image side in pixels, for an image model (--task image-classification; "
        "default: the config's image_size). Replaces --seq-len.",
        show_default=False,
    ),
]


def sample_size(
    info: ModelInfo,
    *,
    seq_len: int | None,
    image_size: int | None,
    lengths: list[str] | None = None,
    padding: str | None = None,
) -> tuple[int, LengthsSummary | None]:
    """The size of one sample to plan memory for, and the lengths summary behind it.

    For a token model: ``--seq-len``, or what ``--lengths`` and ``--padding`` say. For an
    image model: ``--image-size`` (the config's own by default), the side of a square image.

    Raises:
        UsageError: options of the other kind of model, a missing or non-positive size, or a
            longest sample beyond the model's learned positions.
    """
    if info.task == "image-classification":
        if seq_len is not None or lengths or padding is not None:
            given = "--seq-len" if seq_len is not None else "--lengths/--padding"
            raise UsageError(
                f"{given} counts tokens; {info.name} is an image model: give --image-size PIXELS"
            )
        size = image_size if image_size is not None else info.arch.image_size
        if size < 1:
            raise UsageError(f"--image-size must be a positive number of pixels, got {size}")
        return size, None
    if image_size is not None:
        raise UsageError(
            f"--image-size is for image models; {info.name} reads tokens: give --seq-len"
        )
    if not lengths:
        if padding is not None:
            raise UsageError("--padding needs --lengths FILE (the dataset's sequence lengths)")
        if seq_len is None:
            raise UsageError("give --seq-len (tokens per sample) or --lengths FILE")
        return seq_len, None
    if seq_len is not None and seq_len < 1:
        raise UsageError(f"--seq-len must be a positive integer, got {seq_len}")
    seen = workload(lengths, padding or "longest", seq_len)
    limit = info.arch.max_positions if info.arch.positional == "learned" else None
    if limit is not None and seq_len is not None and seq_len > limit:
        raise UsageError(
            f"--seq-len {seq_len} is more than {info.name}'s {limit} learned positions: give "
            f"--seq-len {limit} or less (longer samples in --lengths are truncated to it)"
        )
    if limit is not None and seen.seq_len > limit:
        raise UsageError(
            f"{first_longer(lengths, limit)} has a sample of more than {info.name}'s {limit} "
            f"learned positions (the longest: {seen.longest:,} tokens): give --seq-len {limit} "
            "to truncate"
        )
    return seen.seq_len, seen
