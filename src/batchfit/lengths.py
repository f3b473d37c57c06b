"""Variable sequence lengths: what a dataset's lengths mean for memory (``--lengths``).

Real batches are not all ``--seq-len`` long. How they are built decides the tokens of the
worst micro-batch, which is what memory must be planned for:

- ``longest`` (dynamic padding, HF's ``DataCollatorWithPadding``): each micro-batch is padded to
  its longest sample, so the worst one is ``micro x`` the longest sample of any dataset in the
  mixture (truncated at ``--seq-len`` when given);
- ``max`` (``padding="max_length"``): every sample is padded to ``--seq-len``;
- ``packed``: samples are concatenated into rows of exactly ``--seq-len`` tokens.

Time follows the tokens a micro-batch computes: ``packed`` and ``max`` rows are always
``--seq-len`` long, and a ``longest`` micro-batch is as long as its longest sample, whose
expected length over random micro-batches of ``n`` samples is

    E[max] = sum over lengths L of L x (F(L)^n - F(L-)^n)

with F the mixture's distribution of (truncated) lengths: the mean at one sample a
micro-batch, the longest sample as micro-batches grow. Memory does not
depend on how many datasets are mixed, only on the longest sample any of them can put in a
micro-batch (seed 002's "multi-task needs more memory" is a statement about lengths).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal, get_args

from batchfit.errors import UsageError

Padding = Literal["longest", "max", "packed"]
PADDINGS: tuple[str, ...] = get_args(Padding)
MAX_FILE_BYTES = 256 * 2**20
MAX_LENGTH = 1 << 24  # 16.8M tokens: past any model's context


@dataclass(frozen=True)
class LengthFile:
    """One dataset's lengths: a histogram (length -> samples) and its mixture weight."""

    path: str
    counts: dict[int, int]
    weight: float

    @property
    def longest(self) -> int:
        return max(self.counts)

    def mean(self, cap: int | None) -> float:
        total = sum(self.counts.values())
        return sum(min(n, cap or n) * c for n, c in self.counts.items()) / total


@dataclass(frozen=True)
class LengthsSummary:
    """The tokens per sample memory is planned for, and what the lengths say besides."""

    seq_len: int  # the worst micro-batch's tokens per sample
    padding: Padding
    longest: int
    mean: float  # weighted over the mixture, after truncation
    samples: int
    files: tuple[str, ...]
    # the mixture's (truncated) lengths and their probabilities, ascending; empty: every
    # micro-batch is ``seq_len`` long (what the step time reads, ``timed_length``)
    distribution: tuple[tuple[int, float], ...] = field(default=(), repr=False)
    specs: tuple[str, ...] = ()  # the --lengths arguments as given (FILE[:WEIGHT])

    @property
    def tokens_per_sample(self) -> float:
        """The dataset's tokens a sample brings, padding not counted: the mean under dynamic
        padding; a packed row's or a padded sample's ``seq_len`` (what ``--train-tokens`` and
        ``--global-batch-tokens`` count)."""
        return self.mean if self.padding == "longest" else float(self.seq_len)

    def timed_length(self, micro_batch_size: int) -> float:
        """Tokens a sample of a micro-batch of ``micro_batch_size`` computes, on average: the
        expected longest of that many random samples under ``longest`` padding, ``seq_len``
        for packed and padded rows.

        Example:
            >>> s = LengthsSummary(400, "longest", 400, 250.0, 2, ("f",), ((100, 0.5), (400, 0.5)))
            >>> s.timed_length(1), s.timed_length(2)  # max of two: 400 unless both are 100
            (250.0, 325.0)
        """
        if self.padding != "longest" or not self.distribution:
            return float(self.seq_len)
        expected, below = 0.0, 0.0
        last = len(self.distribution) - 1
        for i, (length, p) in enumerate(self.distribution):
            upto = 1.0 if i == last else min(below + p, 1.0)  # no rounding left at the top
            expected += length * (upto**micro_batch_size - below**micro_batch_size)
            below = upto
        return expected

    def describe(self, micro_batch_size: int | None = None) -> str:
        how = {
            "longest": f"padded to the longest sample ({self.longest:,} tokens"
            + (", truncated" if self.seq_len < self.longest else "")
            + ")",
            "max": "every sample padded to --seq-len",
            "packed": "packed rows of --seq-len tokens",
        }[self.padding]
        return (
            f"lengths: {self.samples:,} sample{'s' * (self.samples != 1)} in {len(self.files)} "
            f"file{'s' * (len(self.files) != 1)}, longest "
            f"{self.longest:,}, mean {self.mean:,.0f}; memory is planned for the worst "
            f"micro-batch, {how}: {self.seq_len:,} tokens per sample; time follows "
            + (
                "each micro-batch's longest sample" + self._timed(micro_batch_size)
                if self.padding == "longest"
                else "the rows' length"
            )
        )

    def _timed(self, micro_batch_size: int | None) -> str:
        """``, X tokens at micro-batch N``: what the step time reads, where a size is given."""
        if micro_batch_size is None:
            return ""
        tokens = self.timed_length(micro_batch_size)
        return (
            f" ({tokens:,.0f} tokens a sample on average at micro-batch {micro_batch_size}, "
            "padding included)"
        )

    def to_json(self, micro_batch_size: int | None = None) -> dict[str, object]:
        timed = {}
        if micro_batch_size is not None:
            timed = {"timed_tokens_per_sample": self.timed_length(micro_batch_size)}
        return {
            **timed,
            "padding": self.padding,
            "seq_len_for_memory": self.seq_len,
            "longest": self.longest,
            "mean": self.mean,
            "samples": self.samples,
            "files": list(self.files),
        }


def _split_weight(spec: str) -> tuple[str, float]:
    """``FILE`` or ``FILE:WEIGHT`` (a path that exists as given wins over the split)."""
    path, sep, weight = spec.rpartition(":")
    if not sep or Path(spec).exists():
        return spec, 1.0
    try:
        value = float(weight)
    except ValueError:
        if Path(path).expanduser().is_file():  # FILE:abc with FILE there: the weight is bad
            raise UsageError(
                f"--lengths {spec!r}: the weight after ':' must be a positive number"
            ) from None
        return spec, 1.0
    if not math.isfinite(value) or value <= 0:
        raise UsageError(f"--lengths {spec!r}: the weight after ':' must be a positive number")
    return path, value


def read_lengths(spec: str) -> LengthFile:
    """Read ``FILE[:WEIGHT]``: one length per line (``#`` comments and blank lines skipped),
    or a JSON object ``{"length": samples, ...}``."""
    path, weight = _split_weight(spec)
    p = Path(path).expanduser()
    try:
        if not p.is_file():
            raise UsageError(f"--lengths {path!r} is not a readable file")
        if p.stat().st_size > MAX_FILE_BYTES:
            raise UsageError(f"--lengths {path!r} is over 256 MiB: give a JSON histogram")
        text = p.read_text()
    except (OSError, UnicodeDecodeError) as e:
        raise UsageError(f"--lengths {path!r} cannot be read: {e}") from e
    counts = _histogram(text, path) if text.lstrip().startswith("{") else _lines(text, path)
    if not counts:
        raise UsageError(
            f"--lengths {path!r} has no lengths: write one length per line, or a JSON object "
            '{"length": samples, ...}'
        )
    return LengthFile(path, counts, weight)


def _positive(value: object, where: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int | str):
        raise UsageError(f"{where}: {value!r} is not a length")
    text = str(value).strip()
    if not text.lstrip("-").isdigit():
        raise UsageError(f"{where}: {text!r} is not a length (a whole number of tokens)")
    number = int(text)
    if number <= 0:
        raise UsageError(f"{where}: a length must be positive, got {number}")
    if number > MAX_LENGTH:
        raise UsageError(
            f"{where}: {number:,} tokens in one sample is more than batchfit plans ({MAX_LENGTH:,})"
        )
    return number


def _lines(text: str, path: str) -> dict[int, int]:
    counts: dict[int, int] = {}
    for number, line in enumerate(text.splitlines(), 1):
        content = line.split("#", 1)[0].strip()
        if content:
            length = _positive(content, f"--lengths {path!r} line {number}")
            counts[length] = counts.get(length, 0) + 1
    return counts


def _histogram(text: str, path: str) -> dict[int, int]:
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        raise UsageError(f"--lengths {path!r} is not valid JSON: {e.msg} (line {e.lineno})") from e
    if not isinstance(data, dict):
        raise UsageError(f"--lengths {path!r}: the JSON must map lengths to sample counts")
    counts: dict[int, int] = {}
    for key, count in data.items():
        where = f"--lengths {path!r} entry {key!r}"
        length = _positive(key, where)
        if isinstance(count, str):
            count = _positive(count, f"{where} (its sample count)")
        if isinstance(count, bool) or not isinstance(count, int) or count <= 0:
            raise UsageError(
                f"{where}: the sample count must be a positive whole number, got {count!r}"
            )
        samples = count
        counts[length] = counts.get(length, 0) + samples
    return counts


def first_longer(specs: list[str], limit: int) -> str:
    """Where the first sample longer than ``limit`` tokens is: ``'FILE' line N`` or
    ``'FILE' entry 'K'`` (files already read once, so they parse)."""
    for spec in specs:
        path, _ = _split_weight(spec)
        text = Path(path).expanduser().read_text()
        if text.lstrip().startswith("{"):
            for key in json.loads(text):
                if int(str(key).strip()) > limit:
                    return f"--lengths {path!r} entry {key!r}"
            continue
        for number, line in enumerate(text.splitlines(), 1):
            content = line.split("#", 1)[0].strip()
            if content and int(content) > limit:
                return f"--lengths {path!r} line {number}"
    return "--lengths"


def workload(specs: list[str], padding: str, seq_len: int | None) -> LengthsSummary:
    r"""The tokens per sample to plan memory for, from the length files and the padding.

    Example:
        >>> import tempfile, os
        >>> path = os.path.join(tempfile.mkdtemp(), "lengths.txt")
        >>> _ = open(path, "w").write("120\n480\n300\n")
        >>> w = workload([path], "longest", None)
        >>> w.seq_len, w.mean
        (480, 300.0)
        >>> workload([path], "longest", 256).seq_len  # truncated at --seq-len
        256
    """
    if padding not in PADDINGS:
        raise UsageError(f"--padding {padding!r} is not one of: {', '.join(PADDINGS)}")
    files = [read_lengths(spec) for spec in specs]
    longest = max(f.longest for f in files)
    if padding in ("max", "packed") and seq_len is None:
        raise UsageError(f"--padding {padding} needs --seq-len (the padded or packed length)")
    worst = min(longest, seq_len or longest)
    if padding != "longest" and seq_len is not None:
        worst = seq_len
    total_weight = sum(f.weight for f in files)
    mean = sum(f.weight * f.mean(seq_len) for f in files) / total_weight
    return LengthsSummary(
        seq_len=worst,
        padding=padding,  # type: ignore[arg-type]
        longest=longest,
        mean=mean,
        samples=sum(sum(f.counts.values()) for f in files),
        files=tuple(f.path for f in files),
        distribution=_distribution(files, seq_len) if padding == "longest" else (),
        specs=tuple(specs),
    )


def sample_tokens(lengths: LengthsSummary | None, seq_len: int, micro_batch_size: int) -> float:
    """Tokens a sample of a micro-batch computes: ``seq_len``, or with ``--lengths`` what
    ``LengthsSummary.timed_length`` says (the expected longest sample under dynamic padding).
    """
    return float(seq_len) if lengths is None else lengths.timed_length(micro_batch_size)


def _distribution(files: list[LengthFile], cap: int | None) -> tuple[tuple[int, float], ...]:
    """The mixture's lengths truncated at ``cap``, each with its probability: a file's samples
    weigh its mixture weight over its sample count."""
    total_weight = sum(f.weight for f in files)
    mass: dict[int, float] = {}
    for f in files:
        share = f.weight / total_weight / sum(f.counts.values())
        for length, count in f.counts.items():
            kept = min(length, cap or length)
            mass[kept] = mass.get(kept, 0.0) + share * count
    return tuple(sorted(mass.items()))
