"""The ``batchfit`` command line: one-line errors with exit code 2, never a traceback."""

from __future__ import annotations

import sys
from typing import Any


def _click_exceptions() -> Any:
    try:  # typer >= 0.2x ships its own copy of click
        from typer._click import exceptions
    except ImportError:  # older typer uses click itself
        from click import exceptions  # type: ignore[no-redef]
    return exceptions


def main(argv: list[str] | None = None) -> None:
    """Run the CLI; bad input prints one line on stderr and exits with code 2."""
    import typer

    from batchfit.errors import UsageError

    exc = _click_exceptions()
    try:
        import typer.main

        from batchfit.cli.app import app

        command = typer.main.get_command(app)
        command.main(
            args=argv if argv is not None else sys.argv[1:],
            prog_name="batchfit",
            standalone_mode=False,
        )
    except UsageError as e:
        print(f"batchfit: error: {e}", file=sys.stderr)
        sys.exit(2)
    except exc.UsageError as e:
        if type(e).__name__ == "NoArgsIsHelpError":  # bare `batchfit`: help is the answer
            print(e.ctx.get_help() if e.ctx is not None else e.format_message())
            sys.exit(0)
        message = " ".join(e.format_message().split())
        hint = f" (see `{e.ctx.command_path} --help`)" if e.ctx is not None else ""
        print(f"batchfit: error: {message}{hint}", file=sys.stderr)
        sys.exit(2)
    except typer.Exit as e:
        sys.exit(e.exit_code)
    except typer.Abort:
        print("batchfit: aborted", file=sys.stderr)
        sys.exit(130)
    except BrokenPipeError:
        sys.exit(0)
