"""The tiny Llama every optimizer's dry-run-against-real and formulas-against-trace tests step."""

from __future__ import annotations

from pathlib import Path

import pytest

from batchfit.models import ModelInfo, resolve_model
from tests._tiny import TINY_LLAMA_JSON


@pytest.fixture
def tiny_llama(tmp_path: Path) -> ModelInfo:
    path = tmp_path / "config.json"
    path.write_text(TINY_LLAMA_JSON)
    return resolve_model(str(path))
