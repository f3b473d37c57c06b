"""The same question again is answered at once: ``plan``, ``gpus`` and ``estimate`` keep what
they printed, and the same command line asked again prints it without importing torch,
transformers or the rest of the CLI (docs/design.md, "answers in seconds").

The key is everything the printed answer depends on:

- the arguments and the working directory (relative paths);
- each argument that names a file or a folder: its size and modification time, a folder's
  files too (a model's ``config.json``, ``--lengths FILE``, ``--throughput-from FILE``);
- the environment that changes what is resolved or printed (``BATCHFIT_*``, the Hugging Face
  variables, ``COLUMNS``, ``NO_COLOR``, ``TERM`` ...), whether stdout and stderr are terminals
  and their size, the CPUs this process may use (``--device cpu``), the calibration file
  (``--headroom auto``, the learned step time);
- through ``batchfit._cache``, the versions of batchfit, its sources, torch and transformers.

Not kept, so always computed: other commands; ``--help``; ``--no-cache`` and ``--verbose``;
the options that write files (``--export``, ``--out``, ``--report``, ``--timeline``,
``--snapshot``); a Python file as the model (what it imports is not in the key); a hub id
that is not a local folder (its config may change upstream); stdin (``-``); and a run that
ends with an exit code other than 0 or 1. The progress line is not kept: a replay has nothing
to wait for.
"""

from __future__ import annotations

import contextlib
import os
import stat
import sys
from collections.abc import Iterator
from typing import Any, TextIO

from batchfit import _cache

NAMESPACE = "answers"
COMMANDS = frozenset({"plan", "gpus", "estimate"})
# options whose run does more than print: computed every time
UNKEPT = frozenset(
    {"-h", "--help", "--no-cache", "-v", "--verbose"}
    | {"--export", "--out", "--report", "--timeline", "--snapshot"}
)
ENV_PREFIXES = ("BATCHFIT_", "HF_", "HUGGINGFACE_", "TRANSFORMERS_")
ENV_NAMES = frozenset(
    {"COLUMNS", "LINES", "NO_COLOR", "FORCE_COLOR", "TERM", "COLORTERM", "TTY_COMPATIBLE"}
)
KEPT_CODES = (0, 1)  # 1: estimate --check's "does not fit", an answer like any other


def _stamp(path: str) -> list[Any] | None:
    """Size and modification time of a file; of each file in a folder; None: not a path."""
    try:
        info = os.stat(path)
    except (OSError, ValueError):
        return None
    if not stat.S_ISDIR(info.st_mode):
        return [info.st_size, info.st_mtime_ns]
    entries = []
    with contextlib.suppress(OSError), os.scandir(path) as found:
        for entry in found:
            with contextlib.suppress(OSError):
                if entry.is_file():
                    s = entry.stat()
                    entries.append([entry.name, s.st_size, s.st_mtime_ns])
    return sorted(entries)


def _terminal(stream: TextIO) -> list[int] | None:
    """A terminal's size (None: not a terminal)."""
    try:
        if not stream.isatty():
            return None
        size = os.get_terminal_size(stream.fileno())
    except (AttributeError, OSError, ValueError):
        return [0, 0]
    return [size.columns, size.lines]


def _calibration_file() -> list[Any] | None:
    """The stamp of the calibration records (``--headroom auto`` and the learned time read
    them)."""
    import platformdirs

    folder = os.environ.get("BATCHFIT_DATA_DIR") or platformdirs.user_data_dir("batchfit")
    return _stamp(os.path.join(folder, "calibration.jsonl"))


def key(argv: list[str]) -> dict[str, Any] | None:
    """What ``argv``'s answer depends on, or None where it is computed every time."""
    if not argv or argv[0] not in COMMANDS:
        return None
    files: dict[str, list[Any]] = {}
    for token in argv[1:]:
        name, equals, value = token.partition("=")
        if name in UNKEPT or token == "-" or ".py" in token:
            return None
        part = value if token.startswith("-") and equals else token
        if part.startswith("-"):
            continue
        found = _stamp(part)
        if found is not None:
            files[part] = found
        elif "/" in part:  # a hub id: its config may change upstream
            return None
    try:
        threads = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        threads = os.cpu_count() or 1
    return {
        "argv": list(argv),
        "cwd": os.getcwd(),
        "files": files,
        "env": {
            k: v for k, v in os.environ.items() if k.startswith(ENV_PREFIXES) or k in ENV_NAMES
        },
        "terminals": [_terminal(sys.stdout), _terminal(sys.stderr)],
        "threads": threads,
        "python": list(sys.version_info[:2]),
        "calibration": _calibration_file(),
    }


class _Tee:
    """A text stream that also keeps what is written to it, in order with the other stream's
    writes (``kept``: [stream name, text] pairs), except inside ``hold``."""

    def __init__(self, stream: TextIO, name: str, kept: list[list[str]]) -> None:
        self.stream, self.name, self.kept = stream, name, kept
        self.held = 0

    def write(self, text: str) -> int:
        written = self.stream.write(text)
        if not self.held and text:
            if self.kept and self.kept[-1][0] == self.name:
                self.kept[-1][1] += text
            else:
                self.kept.append([self.name, text])
        return written

    @contextlib.contextmanager
    def hold(self) -> Iterator[None]:
        """Nothing written inside is kept (the progress line)."""
        self.held += 1
        try:
            yield
        finally:
            self.held -= 1

    def __getattr__(self, name: str) -> Any:
        return getattr(self.stream, name)


class Recorder:
    """What one command prints, kept under its key once it has ended with an answer."""

    def __init__(self, parts: dict[str, Any]) -> None:
        self.parts = parts
        self.kept: list[list[str]] = []
        out, err = _Tee(sys.stdout, "stdout", self.kept), _Tee(sys.stderr, "stderr", self.kept)
        sys.stdout, sys.stderr = out, err

    def keep(self, code: int) -> None:
        """Store the output if ``code`` is an answer's (``KEPT_CODES``)."""
        if code in KEPT_CODES:
            _cache.store(NAMESPACE, self.parts, {"output": self.kept, "code": code})


def hold() -> contextlib.AbstractContextManager[None]:
    """Inside, what stderr shows is not kept (the progress line, redrawn in place)."""
    held = getattr(sys.stderr, "hold", None)
    return held() if callable(held) else contextlib.nullcontext()


def _valid(record: dict[str, Any]) -> bool:
    """A record of this module's shape (another is a miss)."""
    output = record.get("output")
    return (
        isinstance(record.get("code"), int)
        and isinstance(output, list)
        and all(
            isinstance(o, list)
            and len(o) == 2
            and o[0] in ("stdout", "stderr")
            and isinstance(o[1], str)
            for o in output
        )
    )


def replay_or_record(argv: list[str]) -> Recorder | None:
    """Print the kept answer of ``argv`` and exit with its code; else a Recorder (None: this
    command is not kept)."""
    parts = key(argv)
    if parts is None or not _cache.enabled():
        return None
    record = _cache.load(NAMESPACE, parts)
    if record is not None and _valid(record):
        try:
            for name, text in record["output"]:
                stream = sys.stdout if name == "stdout" else sys.stderr
                stream.write(text)
                stream.flush()
        except BrokenPipeError:  # `| head`: the reader's choice, as when computed
            with contextlib.suppress(OSError, ValueError):
                os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
            sys.exit(0)
        sys.exit(int(record["code"]))
    return Recorder(parts)
