"""The tiny GPT-2 the tests plan and train on the CPU: examples/train_tiny_gpt2.py's own
config (2 layers of width 64, a vocabulary of 96), read from the example so the two agree."""

from __future__ import annotations

import runpy
from pathlib import Path
from typing import Any

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "train_tiny_gpt2.py"
TINY_GPT2: dict[str, Any] = dict(runpy.run_path(str(EXAMPLE))["CONFIG"])
