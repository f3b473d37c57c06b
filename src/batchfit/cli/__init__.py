"""The ``batchfit`` command line: one-line errors with exit code 2, never a traceback.

Exit codes: 0 done; 2 bad input or an output that cannot be written (one line on stderr);
130 Ctrl-C and 143 SIGTERM (one line on stderr). A reader that closes the pipe early
(``batchfit models | head -3``) gets a quiet exit 0: stopping the reader is the reader's
choice, not a failure of the command, and ``set -o pipefail`` scripts must not fail on it.
"""

from __future__ import annotations

import contextlib
import errno
import os
import signal
import sys
from collections.abc import Iterator
from types import FrameType
from typing import TYPE_CHECKING, Any

from batchfit.errors import CLI_SPELLING_ENV, RankFailure, UsageError

if TYPE_CHECKING:
    from batchfit.cli._answers import Recorder

EXIT_USAGE = 2
EXIT_INTERRUPTED = 130
EXIT_TERMINATED = 143


class Terminated(BaseException):
    """SIGTERM, raised where the program is so that ``finally`` blocks run (progress bar,
    the probe's child); a BaseException like KeyboardInterrupt, so no ``except Exception``
    swallows it."""


def _click_exceptions() -> Any:
    try:  # typer >= 0.2x ships its own copy of click
        from typer._click import exceptions
    except ImportError:  # older typer uses click itself
        from click import exceptions  # type: ignore[no-redef,unused-ignore]
    return exceptions


def _fail(message: str, code: int, *, at_once: bool = False) -> None:
    """``batchfit: message`` on stderr, then exit ``code``; ``at_once`` skips the
    interpreter's teardown (a second with torch loaded): a stopped command has nothing left
    to write, and its ``finally`` blocks have run."""
    with contextlib.suppress(OSError, ValueError, AttributeError):
        print(f"batchfit: {message}", file=sys.stderr, flush=True)
    if at_once:
        os._exit(code)
    sys.exit(code)


def _silence_stdout() -> None:
    """Point fd 1 at /dev/null so the interpreter's last flush cannot fail again."""
    with contextlib.suppress(OSError, ValueError, AttributeError):
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())


def _on_sigterm(_signum: int, _frame: FrameType | None) -> None:
    raise Terminated


@contextlib.contextmanager
def _sigterm_raises() -> Iterator[None]:
    try:
        previous = signal.signal(signal.SIGTERM, _on_sigterm)
    except ValueError:  # not the main thread: leave signals alone
        yield
        return
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


_COMMAND: Any = None  # the click command typer builds from the app, once


def _run(argv: list[str]) -> None:
    """Parse and invoke, as click's ``main`` does, minus its exit-code handling."""
    # the commands load when the CLI runs: importing one part of batchfit.cli stays light
    import typer.main

    from batchfit.cli.app import app

    global _COMMAND
    if _COMMAND is None:  # built once a process (tens of milliseconds)
        _COMMAND = typer.main.get_command(app)
    command = _COMMAND
    with command.make_context("batchfit", argv) as ctx:
        command.invoke(ctx)
    sys.stdout.flush()  # a full disk must show here, not in the interpreter's last flush


def _keep(recorder: Recorder | None, code: int) -> None:
    """The answer kept for the next time the same question is asked (never fails the run)."""
    if recorder is not None:
        with contextlib.suppress(Exception):
            recorder.keep(code)


def main(argv: list[str] | None = None) -> None:
    """Run the CLI; bad input prints one line on stderr and exits with code 2. From the command
    line (``argv`` None), a question asked before is answered from what it printed then
    (``cli/_answers.py``)."""
    if sys.stdout is None:  # started with stdout closed: the answer would be lost
        _fail("error: stdout is closed: run with stdout open or redirected to a file", 2)
    recorder = None
    if argv is None:
        from batchfit.cli._answers import replay_or_record

        recorder = replay_or_record(sys.argv[1:])  # exits on a kept answer
    # typer (and its pydantic) loads only when a command runs
    import typer

    exc = _click_exceptions()
    spelling = os.environ.get(CLI_SPELLING_ENV)
    os.environ[CLI_SPELLING_ENV] = "1"  # errors name options, in the probe's ranks too
    try:
        with _sigterm_raises():
            _run(argv if argv is not None else sys.argv[1:])
        _keep(recorder, 0)
    except UsageError as e:
        _fail(f"error: {e}", EXIT_USAGE)
    except RankFailure as e:  # a probe rank died: nothing the user typed was wrong
        _fail(f"error: {e}", 1)
    except exc.UsageError as e:
        if type(e).__name__ == "NoArgsIsHelpError":  # bare `batchfit`: help is the answer
            print(e.ctx.get_help() if e.ctx is not None else e.format_message())
            sys.exit(0)
        message = " ".join(e.format_message().split())
        hint = f" (see `{e.ctx.command_path} --help`)" if e.ctx is not None else ""
        _fail(f"error: {message}{hint}", EXIT_USAGE)
    except typer.Exit as e:
        _keep(recorder, e.exit_code)
        sys.exit(e.exit_code)
    except (KeyboardInterrupt, typer.Abort):
        _silence_stdout()
        _fail("interrupted", EXIT_INTERRUPTED, at_once=argv is None)
    except Terminated:
        _silence_stdout()
        _fail("terminated", EXIT_TERMINATED, at_once=argv is None)
    except OSError as e:
        _silence_stdout()
        if e.errno == errno.EPIPE:
            sys.exit(0)
        if e.filename is not None:  # a path the user gave (MODEL, a config): one line too
            name = str(e.filename)
            shown = name if len(name) <= 120 else f"{name[:60]}...{name[-40:]}"
            _fail(f"error: cannot use {shown}: {e.strerror or e}", EXIT_USAGE)
        _fail(f"error: cannot write the output: {e.strerror or e}", EXIT_USAGE)
    finally:
        if spelling is None:
            os.environ.pop(CLI_SPELLING_ENV, None)
        else:
            os.environ[CLI_SPELLING_ENV] = spelling
