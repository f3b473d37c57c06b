import json
import os
from typing import Any

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
# pytest-xdist's workers inherit COLUMNS=80 from the controller's terminal writer: the commands
# under test draw as into a pipe (160 columns) unless a test sets a width itself
os.environ.pop("COLUMNS", None)
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
# Two workers share the two cores: a real CPU step on two OpenMP threads each stalls on the
# other worker's (a tiny GPT-2's step 60x slower). One thread per process, children included.
os.environ.setdefault("OMP_NUM_THREADS", "1")
# The same for the dry runs: a pair is traced in this process, not beside a helper process
# (tests/memory/test_trace_helper.py turns it on)
os.environ.setdefault("BATCHFIT_TRACE_JOBS", "1")

# Dry-run results are cached on disk: one fresh cache per test run, never the user's.
if "BATCHFIT_CACHE_DIR" not in os.environ:
    import tempfile

    os.environ["BATCHFIT_CACHE_DIR"] = tempfile.mkdtemp(prefix="batchfit-test-cache-")

# Calibration records (plan and estimate scale their time by them): never the user's
if "BATCHFIT_DATA_DIR" not in os.environ:
    import tempfile

    os.environ["BATCHFIT_DATA_DIR"] = tempfile.mkdtemp(prefix="batchfit-test-data-")


# --- a step's timeline, shared by the tests of its data (memory/) and of its picture (views/) ---


@pytest.fixture(scope="session")
def timeline_config(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A config.json path of ``tests._tiny.TIMELINE_GPT2``."""
    from tests._tiny import TIMELINE_GPT2

    path = tmp_path_factory.mktemp("timeline") / "config.json"
    path.write_text(json.dumps(TIMELINE_GPT2))
    return str(path)


@pytest.fixture(scope="session")
def cuda_timeline(timeline_config: str) -> Any:
    """The timeline of that model on a T4, micro-batch 2 x 64 tokens, accumulation 2 (one dry
    run for every test that reads it)."""
    from batchfit.hardware import get_gpu
    from batchfit.memory.formulas.analytic import resolve_setup
    from batchfit.memory.trace.timeline import step_timeline
    from batchfit.models import resolve_model
    from batchfit.spec import TrainingSetup

    model, gpu = resolve_model(timeline_config), get_gpu("t4")
    setup = resolve_setup(model, TrainingSetup(), "cuda", gpu)
    return step_timeline(
        model, setup, micro_batch_size=2, seq_len=64, device="cuda", gpu=gpu, grad_accum_steps=2
    )


# --- out-of-memory recovery in this process ---


@pytest.fixture(scope="module")
def frozen_gc() -> Any:
    """The objects alive before a module's tests (the imported libraries: torch, transformers)
    moved out of the collector's reach for the module: each caught out-of-memory error's full
    ``gc.collect()`` (``release_memory``) then scans only the objects the tests made, the
    failed steps' among them."""
    import gc

    gc.collect()
    gc.freeze()
    yield
    gc.unfreeze()
