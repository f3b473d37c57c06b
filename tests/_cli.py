"""Run the CLI in-process for tests: (exit code, stdout, stderr)."""

from __future__ import annotations

import pytest

from batchfit.cli import main


def run_cli(args: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    with pytest.raises(SystemExit) as exc:
        main(args)
        raise SystemExit(0)
    captured = capsys.readouterr()
    return int(exc.value.code or 0), captured.out, captured.err
