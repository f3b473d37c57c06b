"""TODO(coordinator): remove this shim when the export branch lands; it has the signature of
``batchfit.export.write_export`` and app.py switches its import to that."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

from batchfit.errors import UsageError

if TYPE_CHECKING:
    from batchfit.plan import Plan


def write_export(plan: Plan, kind: str, out: Path) -> dict[str, str]:
    """Write the ``kind`` export of ``plan`` to ``out`` only, through a temporary file renamed
    over it, so an interrupted write never leaves half a file; return ``{kind: path}``."""
    from batchfit.export import export, render

    text = render(export(plan, kind), kind)
    try:
        fd, tmp = tempfile.mkstemp(dir=out.parent, prefix=f".{out.name}.", suffix=".tmp")
        try:
            with os.fdopen(fd, "w", encoding="utf-8") as f:
                f.write(text)
            os.replace(tmp, out)
        except BaseException:
            os.unlink(tmp)
            raise
    except OSError as e:
        raise UsageError(f"cannot write --out {out}: {e.strerror or e}") from None
    return {kind: str(out)}
