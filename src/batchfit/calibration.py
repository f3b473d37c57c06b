"""The calibration loop: every time a measured peak sits beside an estimate for the same setup
(``monitor --plan``, the probe, the training callbacks with a plan), one record is appended to a
local file; ``batchfit calibration`` shows the errors, and ``plan --headroom auto`` takes its
headroom from them.

Where the run timed its steps beside a plan's predicted step time, the record keeps both
(``estimated_seconds``, ``measured_seconds``), and ``plan`` and ``estimate`` scale the time
model by what the runs on that GPU measured (:func:`time_factor`).

The file is JSON lines in the user's data dir (``platformdirs.user_data_dir("batchfit")``,
``BATCHFIT_DATA_DIR`` to move it): one record per measurement, never rewritten. A file that
cannot be read is set aside (renamed ``*.corrupt-<time>``) with one warning, and a new one
started: a calibration file never stops a command.
"""

from __future__ import annotations

import json
import math
import os
import time
import warnings
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

import platformdirs

from batchfit._version import __version__

FILE_NAME = "calibration.jsonl"
# the headroom a plan keeps when it has no records, and the least it keeps with them
DEFAULT_HEADROOM_FRACTION = 0.05
HEADROOM_FLOOR_FRACTION = 0.02
MIN_RECORDS = 5  # fewer records than this: the default, and the output says why
# A step time a record may hold (a microsecond to four months), and how far a run may be from
# the time model to count: beyond 4x either way the run measured another setup than the one
# planned, and scaling every plan by it would mislead
MIN_STEP_SECONDS = 1e-6
MAX_STEP_SECONDS = 1e7
MAX_TIME_RATIO = 4.0
# runs of other models on a GPU scale a model's time only when there are this many
MIN_OTHER_RUNS = 3


@dataclass(frozen=True)
class Record:
    """One estimate beside its measurement (bytes), and where it was measured."""

    source: str  # monitor | probe | hf-callback | lightning-callback
    model: str
    setup: str  # the setup the estimate was for, as a short key (JSON of its fields)
    device: str  # the GPU kind (catalog name or the device's name) or "cpu"
    estimated_bytes: int
    measured_bytes: int
    reserved_bytes: int | None = None
    torch: str = ""
    batchfit: str = ""
    time: float = 0.0
    # one optimizer step: the time model's seconds for the setup, and the run's median
    estimated_seconds: float | None = None
    measured_seconds: float | None = None

    @property
    def time_ratio(self) -> float | None:
        """Measured over predicted step time; None where the run did not time its steps."""
        if not self.estimated_seconds or not self.measured_seconds:
            return None
        return self.measured_seconds / self.estimated_seconds

    @property
    def error(self) -> float:
        """Measured over estimated, minus one: above zero the estimate was short."""
        return self.measured_bytes / self.estimated_bytes - 1


def setup_key(estimate: Any) -> str:
    """The setup a ``MemoryEstimate`` was made for, with its micro-batch and sequence length,
    as a record's ``setup`` (the same key wherever the estimate came from)."""
    fields = {
        "setup": estimate.to_json()["setup"],
        "micro": estimate.micro_batch_size,
        "seq": estimate.seq_len,
    }
    return json.dumps(fields, sort_keys=True, default=str)


def path() -> Path:
    """Where the records live."""
    override = os.environ.get("BATCHFIT_DATA_DIR")
    if override:
        return Path(override) / FILE_NAME

    return Path(platformdirs.user_data_dir("batchfit")) / FILE_NAME


def append(record: Record) -> bool:
    """Add ``record``; False (and no error) where the file cannot be written."""
    filled = record
    if not record.torch or not record.batchfit:
        filled = Record(**{**asdict(record), "batchfit": __version__, "torch": _torch_version()})
    if not filled.time:
        filled = Record(**{**asdict(filled), "time": time.time()})
    target = path()
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        with open(target, "a+b") as f:
            # a write cut off left no line end: the record must not join that fragment
            f.seek(0, os.SEEK_END)
            cut = False
            if f.tell():
                f.seek(-1, os.SEEK_END)
                cut = f.read(1) != b"\n"
            line = json.dumps(asdict(filled), allow_nan=False) + "\n"
            f.write((b"\n" if cut else b"") + line.encode())
    except (OSError, ValueError):
        return False
    return True


def _torch_version() -> str:
    # lazy: importlib.metadata is most of `import batchfit`'s cost (email, zipfile, csv)
    import importlib.metadata

    try:
        return importlib.metadata.version("torch")
    except importlib.metadata.PackageNotFoundError:
        return ""


def load(warn: Callable[[str], None] | None = None) -> list[Record]:
    """Every record. Lines that do not parse (a write cut off, an edit gone wrong) are moved to
    a file beside it and the rest kept; a file with no record at all (not UTF-8, not JSON
    lines) is set aside whole. Either way one warning: ``warn(message)`` when given (the CLI
    prints it as one line), else a ``UserWarning``."""
    target = path()
    try:
        data = target.read_bytes()
    except OSError:  # none yet, or unreadable: no records, and nothing to set aside
        return []
    records: list[Record] = []
    good: list[str] = []
    bad: list[str] = []
    try:
        lines = data.decode("utf-8").splitlines()
    except UnicodeDecodeError:
        lines, bad = [], [""]
    for line in lines:
        if not line.strip():
            continue
        try:
            records.append(_record(json.loads(line)))
            good.append(line)
        except (ValueError, TypeError, KeyError):
            bad.append(line)
    if not bad:
        return records
    aside = target.with_name(f"{target.name}.corrupt-{int(time.time())}")
    for n in range(1, 1000):  # two set aside in one second: neither overwrites the other
        if not aside.exists():
            break
        aside = target.with_name(f"{target.name}.corrupt-{int(time.time())}-{n}")
    if not records:
        try:
            target.rename(aside)
            where = f"set aside as {aside}"
        except OSError:
            where = "left in place"
        message = f"the calibration file {target} could not be read; {where}, a new one is started"
    else:
        try:
            aside.write_text("".join(line + "\n" for line in bad))
            target.write_text("".join(line + "\n" for line in good))
            where = f"set aside in {aside}"
        except OSError:
            where = "skipped"
        lines_word = "line" if len(bad) == 1 else "lines"
        kept = "its record" if len(records) == 1 else f"its {len(records)} records"
        message = (
            f"{len(bad)} {lines_word} of the calibration file {target} could not be read "
            f"(a write cut off?); {where}, {kept} kept"
        )
    if warn is not None:
        warn(message)
    else:
        warnings.warn(message, stacklevel=2)
    return records


_FIELDS = {f.name for f in fields(Record)}


def _record(data: Any) -> Record:
    if not isinstance(data, dict):
        raise ValueError("not a record")
    # a field a newer batchfit added is left out, not the record
    record = Record(**{k: v for k, v in data.items() if k in _FIELDS})
    for text in (record.source, record.model, record.setup, record.device, record.torch):
        if not isinstance(text, str):
            raise ValueError("not a record")
    if not isinstance(record.batchfit, str) or not isinstance(record.time, int | float):
        raise ValueError("not a record")
    if not isinstance(record.estimated_bytes, int) or record.estimated_bytes <= 0:
        raise ValueError("bad estimate")
    if not isinstance(record.measured_bytes, int) or record.measured_bytes < 0:
        raise ValueError("bad measurement")
    for seconds in (record.estimated_seconds, record.measured_seconds):
        if seconds is not None and (
            isinstance(seconds, bool)
            or not isinstance(seconds, int | float)
            or not MIN_STEP_SECONDS <= seconds <= MAX_STEP_SECONDS
        ):
            raise ValueError("bad step time")
    return record


@dataclass(frozen=True)
class TimeFactor:
    """Measured over predicted step time, from the runs recorded on one GPU."""

    factor: float
    runs: int
    model: str | None  # the model the runs trained, where all were this model's
    others: tuple[str, ...] = ()  # else the models they trained

    def describe(self) -> str:
        """``model x 0.91, from 3 runs of gpt2 on this GPU``."""
        runs = f"{self.runs} run{'s' * (self.runs != 1)}"
        if self.model:
            return f"model x {self.factor:.2f}, from {runs} of {self.model} on this GPU"
        named = ", ".join(self.others[:3]) + (", ..." if len(self.others) > 3 else "")
        return f"model x {self.factor:.2f}, from {runs} of other models on this GPU ({named})"

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> TimeFactor:
        """The value ``to_json`` wrote."""
        others = tuple(data.get("others", ()))
        return cls(float(data["factor"]), int(data["runs"]), data.get("model"), others)

    def to_json(self) -> dict[str, Any]:
        return {
            "factor": self.factor,
            "runs": self.runs,
            "model": self.model,
            "others": list(self.others),
        }


def time_factor(records: Iterable[Record], device: str, model: str) -> TimeFactor | None:
    """How the time model's step times compare with the steps runs measured on ``device``:
    the median of measured over predicted, over the runs of ``model`` there where it has
    any, else over the runs of other models there when there are ``MIN_OTHER_RUNS``; None
    otherwise. A run more than ``MAX_TIME_RATIO`` off the model either way is not counted.

    Example:
        >>> r = [Record("hf-callback", m, "s", "a100-80gb", 1, 1, estimated_seconds=2.0,
        ...             measured_seconds=s) for m, s in (("gpt2", 1.8), ("gpt2", 1.9),
        ...                                               ("llama", 3.0), ("opt", 90.0))]
        >>> time_factor(r, "a100-80gb", "gpt2").describe()
        'model x 0.93, from 2 runs of gpt2 on this GPU'
        >>> time_factor(r + r[:1], "a100-80gb", "bert").describe()  # no run of bert
        'model x 0.93, from 4 runs of other models on this GPU (gpt2, llama)'
        >>> time_factor(r[2:], "a100-80gb", "bert") is None  # opt's 45x is not counted
        True
        >>> time_factor(r, "t4", "gpt2") is None
        True
    """
    timed = [
        (r, x)
        for r in records
        if r.device == device and (x := r.time_ratio) is not None and _counted(x)
    ]
    mine = [(r, x) for r, x in timed if r.model == model]
    chosen = mine or (timed if len(timed) >= MIN_OTHER_RUNS else [])
    if not chosen:
        return None
    factor = round(percentile([x for _, x in chosen], 50), 4)
    if mine:
        return TimeFactor(factor, len(chosen), model)
    return TimeFactor(factor, len(chosen), None, tuple(sorted({r.model for r, _ in chosen})))


def _counted(ratio: float) -> bool:
    """Whether a run's measured-over-predicted step time counts: within ``MAX_TIME_RATIO``
    of the model either way."""
    return 1 / MAX_TIME_RATIO <= ratio <= MAX_TIME_RATIO


def percentile(values: list[float], q: float) -> float:
    """The ``q``-th percentile (0-100), linear between the closest ranks."""
    ordered = sorted(values)
    if not ordered:
        raise ValueError("no values")
    k = (len(ordered) - 1) * q / 100
    lo, hi = math.floor(k), math.ceil(k)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (k - lo)


@dataclass(frozen=True)
class Headroom:
    """A plan's headroom as a fraction of its device total, and what backs it."""

    fraction: float
    records: int
    why: str


def auto_headroom(records: Iterable[Record], device: str | None = None) -> Headroom:
    """The 99th percentile of how far measurements came above their estimates (for
    ``device`` when it has enough records of its own), at least ``HEADROOM_FLOOR_FRACTION``;
    the default when there are fewer than ``MIN_RECORDS``. CPU records count only for
    ``device="cpu"``, and GPU records only for a GPU.

    Example:
        >>> r = [Record("monitor", "m", "s", "t4", 100, 103) for _ in range(5)]
        >>> auto_headroom(r).fraction
        0.03
    """
    # a CPU record (RSS against an estimate plus the Python runtime) says nothing of a GPU's
    # allocator: it counts only for the CPU
    every = [r for r in records if (r.device == "cpu") == (device == "cpu")]
    mine = [r for r in every if device is not None and r.device == device]
    chosen = mine if len(mine) >= MIN_RECORDS else every
    if len(chosen) < MIN_RECORDS:
        return Headroom(
            DEFAULT_HEADROOM_FRACTION,
            len(chosen),
            f"{len(chosen)} calibration record(s), fewer than {MIN_RECORDS}: the default "
            f"{DEFAULT_HEADROOM_FRACTION:.0%}",
        )
    p99 = percentile([r.error for r in chosen], 99)
    fraction = round(max(HEADROOM_FLOOR_FRACTION, p99), 4)
    scope = f"on {device}" if chosen is mine else "on every device"
    return Headroom(
        fraction,
        len(chosen),
        f"99th percentile of {len(chosen)} calibration records {scope}: measured "
        f"{p99:+.1%} over the estimate (floor {HEADROOM_FLOOR_FRACTION:.0%})",
    )


def time_summary(records: Iterable[Record]) -> list[dict[str, Any]]:
    """The runs that timed their steps, by device and model: how many, and the median of
    measured over predicted step time (rows for ``batchfit calibration``)."""
    groups: dict[tuple[str, str], list[float]] = {}
    for r in records:
        if (ratio := r.time_ratio) is not None:
            groups.setdefault((r.device, r.model), []).append(ratio)
    return [
        {
            "device": device,
            "model": model,
            "runs": len(ratios),
            "median": percentile(ratios, 50),
            "counted": sum(map(_counted, ratios)),
        }
        for (device, model), ratios in sorted(groups.items())
    ]


def summary(records: Iterable[Record]) -> list[dict[str, Any]]:
    """Error statistics by (device, torch version): rows for ``batchfit calibration``."""
    groups: dict[tuple[str, str], list[float]] = {}
    for r in records:
        groups.setdefault((r.device, r.torch), []).append(r.error)
    rows = []
    for (device, torch_version), errors in sorted(groups.items()):
        rows.append(
            {
                "device": device,
                "torch": torch_version,
                "records": len(errors),
                "median": percentile(errors, 50),
                "p90": percentile(errors, 90),
                "p99": percentile(errors, 99),
                "worst": max(errors, key=abs),
            }
        )
    return rows
