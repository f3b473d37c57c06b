"""The ``batchfit`` command line: one-line errors with exit code 2, never a traceback."""

from __future__ import annotations

import sys


def main(argv: list[str] | None = None) -> None:
    """Run the CLI; bad input prints one line on stderr and exits with code 2."""
    import click

    from batchfit.errors import UsageError

    try:
        from batchfit.cli.app import app
        import typer.main

        command = typer.main.get_command(app)
        command.main(args=argv if argv is not None else sys.argv[1:], prog_name="batchfit",
                     standalone_mode=False)
    except UsageError as e:
        print(f"batchfit: error: {e}", file=sys.stderr)
        sys.exit(2)
    except click.exceptions.NoArgsIsHelp as e:
        print(e.format_message() if hasattr(e, "format_message") else "", file=sys.stderr)
        sys.exit(2)
    except click.UsageError as e:
        hint = f" (see `{e.ctx.command_path} --help`)" if e.ctx is not None else ""
        print(f"batchfit: error: {e.format_message()}{hint}", file=sys.stderr)
        sys.exit(2)
    except click.exceptions.Exit as e:
        sys.exit(e.exit_code)
    except click.Abort:
        print("batchfit: aborted", file=sys.stderr)
        sys.exit(130)
    except BrokenPipeError:
        sys.exit(0)
