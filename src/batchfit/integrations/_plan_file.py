"""What the training callbacks need of a plan, from a ``Plan`` or from the file ``batchfit plan
... --json`` wrote (planned on a laptop, trained on a cluster): the model, the GPU, the peak to
expect, the parameter count the model check compares, and the setup key of a calibration
record."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from batchfit import calibration
from batchfit.errors import UsageError
from batchfit.models import resolve_model
from batchfit.plan import Plan


@dataclass(frozen=True)
class PlanFigures:
    """A plan as the callbacks read it.

    Attributes:
        model: The plan's model (a catalog name, or the config's path as planned).
        gpu: The plan's GPU (catalog name).
        peak_bytes: The step's expected peak (``torch.cuda.max_memory_allocated``).
        total_params: The parameters the plan counted; None where a file does not say and
            its model cannot be resolved here (then the model is not checked).
        setup_key: The setup, micro-batch and sequence length, as a calibration record keys
            them (``calibration.setup_key``).
        step_seconds: The time model's seconds of one optimizer step (before any measured
            correction); None where the plan has no step time.
    """

    model: str
    gpu: str
    peak_bytes: int
    total_params: int | None
    setup_key: str
    step_seconds: float | None = None


def plan_figures(plan: Plan | str | os.PathLike[str]) -> PlanFigures:
    """``plan``'s figures: a ``Plan``, or the path of a ``plan --json`` file.

    Raises:
        ValueError: the path cannot be read or is not a plan's JSON (one line naming it).

    Example:
        >>> import json, os, tempfile
        >>> from batchfit.hardware import get_gpu
        >>> from batchfit.models import resolve_model
        >>> from batchfit.plan import make_plan
        >>> from batchfit.spec import TrainingSetup
        >>> plan = make_plan(resolve_model("gpt2"), get_gpu("t4"), TrainingSetup(), seq_len=256,
        ...                  global_batch=16, engine="analytic")
        >>> with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        ...     json.dump(plan.to_json(), f)
        >>> plan_figures(f.name) == plan_figures(plan)
        True
        >>> os.remove(f.name)
    """
    if isinstance(plan, Plan):
        est = plan.estimate
        return PlanFigures(
            plan.model,
            plan.gpu,
            est.peak_bytes,
            est.total_params,
            calibration.setup_key(est),
            plan.model_step_seconds,
        )
    if isinstance(plan, (str, os.PathLike)):
        return read_plan_file(Path(plan))
    raise TypeError(
        f"plan must be a batchfit Plan or the path of a `batchfit plan ... --json` file, "
        f"not {type(plan).__name__}"
    )


def read_plan_file(path: Path) -> PlanFigures:
    """Read ``batchfit plan ... --json``'s output from ``path``.

    Raises:
        ValueError: one line naming the path and what is wrong with it.
    """
    fix = "give the file `batchfit plan ... --json > plan.json` wrote"
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except OSError as e:
        raise ValueError(f"cannot read the plan file {path}: {e.strerror}") from None
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise ValueError(f"the plan file {path} is not JSON: {fix}") from None
    if not isinstance(data, dict) or not isinstance(data.get("setup"), dict):
        raise ValueError(f"{path} is not a plan's JSON (no setup): {fix}")
    missing = [k for k in ("model", "gpu", "micro_batch_size", "peak_bytes") if k not in data]
    if missing:
        raise ValueError(f"{path} is not a plan's JSON (no {', '.join(missing)}): {fix}")
    peak = _whole(data, "peak_bytes", path, fix)
    micro = _whole(data, "micro_batch_size", path, fix)
    # an image model's plan has seq_len null and its side in image_size (Plan.to_json)
    seq = data.get("seq_len") if data.get("seq_len") is not None else data.get("image_size")
    # the same key calibration.setup_key gives the Plan's estimate
    key = json.dumps(
        {"setup": data["setup"], "micro": micro, "seq": seq}, sort_keys=True, default=str
    )
    model = str(data["model"])
    params = data.get("total_params")  # an estimate's JSON has it; a plan's may
    total = int(params) if isinstance(params, int) and params > 0 else _resolved_params(model)
    # the time model's own step time (a file from before it was written: the plan's)
    seconds = data.get("model_step_seconds", data.get("step_seconds"))
    if isinstance(seconds, bool) or not isinstance(seconds, int | float) or seconds <= 0:
        seconds = None
    return PlanFigures(model, str(data["gpu"]), peak, total, key, seconds)


def _whole(data: dict[str, Any], key: str, path: Path, fix: str) -> int:
    value = data[key]
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        shown = json.dumps(value)[:40]
        raise ValueError(f"the plan file {path}: {key} is {shown}, not a whole number: {fix}")
    return value


def _resolved_params(model: str) -> int | None:
    """The parameter count of the plan's model where it resolves here (a catalog name, a
    config.json on this machine, a bare size); None elsewhere."""
    try:
        return resolve_model(model.removeprefix("generic-")).total_params
    except (UsageError, ValueError, OSError):
        return None
