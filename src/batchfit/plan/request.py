"""``PlanRequest``: everything a plan needs, checked once before any estimate runs.

The rules here are about the plan, not the command line: the target batch in samples or
tokens (tokens only for a model that reads them), the run's length in tokens, samples or
epochs of a dataset, the headroom in bytes, a size or ``"auto"``, the GPU count or
``"auto"``, the base LR with its batch. ``make_plan(request)`` plans it; ``batchfit plan``
parses its options into one and checks nothing of its own, so a Python caller gets the
command's errors, in the same order. A bad value raises ``UsageError`` (a ``ValueError``)
naming it and the fix.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, Literal

from batchfit._units import gib, parse_size
from batchfit.errors import UsageError
from batchfit.hardware import GpuSpec
from batchfit.memory.estimate import check_workload
from batchfit.models import ModelInfo
from batchfit.plan._divisors import MAX_N, divisors_near
from batchfit.plan._gpu_count import DEFAULT_MAX_GPUS, gpu_counts
from batchfit.plan._limits import check_accumulation
from batchfit.plan._lr_scaling import DEFAULT_BETAS, DEFAULT_EPS, lr_options
from batchfit.plan._max_micro_batch import DEFAULT_HEADROOM_BYTES
from batchfit.plan._own import OwnModel, own_model
from batchfit.plan._prices import GpuHourPrice
from batchfit.plan._prices import gpu_hour_price as _hour_price
from batchfit.plan._throughput import ProbeFile
from batchfit.spec import TrainingSetup, check_choice

if TYPE_CHECKING:
    from batchfit.lengths import LengthsSummary

__all__ = ["ENGINES", "PlanRequest", "samples_from_target"]

Engine = Literal["trace", "analytic"]
ENGINES: tuple[Engine, ...] = ("trace", "analytic")
ALTERNATIVES = ("lines", "traced")  # how a plan's alternatives are sized (PlanRequest)
_IMAGE_TASK = "image-classification"


@dataclass(frozen=True)
class PlanRequest:
    """One plan's inputs, validated in ``__post_init__``.

    Args:
        model: A resolved catalog or config model (``resolve_model``), or a zero-argument
            factory of your own ``nn.Module`` (then ``batch_fn`` is needed).
        gpu: The catalog GPU (``get_gpu``).
        setup: How the run trains; its ``num_gpus`` is the GPU count unless ``num_gpus`` says.
        global_batch: The target global batch in samples (this or ``global_batch_tokens``).
        global_batch_tokens: The target global batch in tokens (a model that reads tokens).
        seq_len: Tokens per sample (a token model; your module's only for a token target).
        image_size: An image model's side in pixels (default: the config's ``image_size``).
        lengths: The dataset's lengths (``batchfit.lengths.workload``): tokens per sample
            are its ``seq_len``, the worst micro-batch's.
        num_gpus: ``"auto"`` to plan on 1, 2, 4, ... up to ``max_gpus`` and pick the count;
            a number is the setup's count (with ``setup.num_gpus`` left at 1 or the same).
        max_gpus: With ``num_gpus="auto"``: the most GPUs tried (default 8).
        micro_batch_size: A fixed micro-batch instead of the largest that fits.
        base_lr: The learning rate tuned at ``base_batch`` (or ``base_batch_tokens``).
        headroom_bytes: Free memory to keep on the GPU: bytes, a size such as ``"1GiB"``, or
            ``"auto"`` (any case): the 99th percentile of ``batchfit calibration``'s records,
            as a fraction of the GPU's memory, which ``make_plan`` reads.
        engine: ``"trace"`` (a dry run; the formulas answer, and say so, without torch) or
            ``"analytic"``.
        alternatives: ``"lines"`` (each alternative's largest micro-batch traced from the
            formulas' size until one fits that the traced slope says is the last; the size
            after it is traced for the chosen one only) or ``"traced"`` (each searched and
            confirmed as the choice is).
        train_tokens: Tokens of the whole run (adds its steps, time and cost).
        train_samples: Samples of the whole run (or ``epochs`` with ``dataset_size``).
        epochs: Passes over ``dataset_size`` samples: the run's length.
        gpu_hour_price: Dollars per GPU-hour (default: the catalog's list price).
        throughput_from: ``probe --json``'s file (or its parsed ``ProbeFile``) for this
            model, setup, sequence length and GPU: its measured steps correct the time model.
        learned_time: Scale the time by the runs recorded on this GPU (off unless asked;
            ``calibration.time_factor``); ``throughput_from`` wins over it.
        batch_fn: Your module's inputs of ``n`` samples, ``batch_fn(n)``.
        loss_fn: Your module's loss, ``loss_fn(out, batch)`` (default ``out.loss``).

    Example:
        >>> from batchfit.models import resolve_model
        >>> from batchfit.hardware import get_gpu
        >>> r = PlanRequest(resolve_model("gpt2"), get_gpu("t4"), seq_len=1024,
        ...                 global_batch_tokens=65536)
        >>> r.global_samples, r.per_gpu_samples
        (64, 64)
        >>> PlanRequest(resolve_model("gpt2"), get_gpu("t4"), seq_len=1024, global_batch=0)
        Traceback (most recent call last):
        ...
        batchfit.errors.UsageError: global_batch must be positive, got 0
    """

    model: ModelInfo | Callable[[], Any]
    gpu: GpuSpec
    setup: TrainingSetup = field(default_factory=TrainingSetup)
    global_batch: int | None = None
    global_batch_tokens: int | None = None
    seq_len: int | None = None
    image_size: int | None = None
    lengths: LengthsSummary | None = None
    num_gpus: int | Literal["auto"] | None = None
    max_gpus: int | None = None
    micro_batch_size: int | None = None
    base_lr: float | None = None
    base_batch: int | None = None
    base_batch_tokens: int | None = None
    base_betas: tuple[float, float] = DEFAULT_BETAS
    base_eps: float = DEFAULT_EPS
    critical_batch: int | None = None
    critical_batch_tokens: int | None = None
    headroom_bytes: int | str = DEFAULT_HEADROOM_BYTES
    engine: Engine = "trace"
    alternatives: Literal["lines", "traced"] = "lines"  # one of ALTERNATIVES
    train_tokens: int | None = None
    train_samples: int | None = None
    epochs: float | None = None
    dataset_size: int | None = None
    gpu_hour_price: float | None = None
    throughput_from: ProbeFile | str | os.PathLike[str] | None = None
    learned_time: bool = False
    batch_fn: Callable[[int], Any] | None = None
    loss_fn: Callable[[Any, Any], Any] | None = None

    def __post_init__(self) -> None:
        # in the order `batchfit plan` has always reported them: with two mistakes, the
        # command and a Python caller name the same one first
        self._check_kinds()
        if self.max_gpus is not None and self.num_gpus != "auto":
            raise UsageError("--max-gpus goes with --num-gpus auto")
        self._check_run_length()
        self._check_headroom()
        self._check_model()
        self._check_sample()
        self._check_gpu_count()
        samples_from_target(
            self.global_batch, self.global_batch_tokens, self.sample_size, self.gpu_count
        )
        self._check_run_size()
        _hour_price(self.gpu_hour_price, self.gpu.name)  # a positive number of dollars
        self._check_batches()
        lr_options(
            self.base_lr,
            self.base_betas,
            self.base_eps,
            self.critical_batch,
            self.critical_batch_tokens,
        )
        self._check_headroom()

    # -- the checks, each one rule or family of rules -------------------------------------

    def _check_kinds(self) -> None:
        if not isinstance(self.gpu, GpuSpec):
            raise UsageError(f"gpu must be a GpuSpec (get_gpu('a100-80gb')), got {self.gpu!r}")
        if not isinstance(self.setup, TrainingSetup):
            raise UsageError(f"setup must be a TrainingSetup, got {self.setup!r}")
        if self.engine not in ENGINES:
            raise UsageError(f"engine must be 'trace' or 'analytic', got {self.engine!r}")
        check_choice("--alternatives", self.alternatives, ALTERNATIVES)

    def _check_model(self) -> None:
        """A catalog model takes its sample size; your own module its batches."""
        if isinstance(self.model, ModelInfo):
            if self.batch_fn is not None or self.loss_fn is not None:
                raise UsageError(
                    f"batch_fn and loss_fn are for your own nn.Module; {self.model.name} is a "
                    "catalog or config model, whose batches batchfit builds: leave them out"
                )
            return
        own_model(self.model, self.batch_fn, self.loss_fn)  # the factory and batch_fn
        if self.engine != "trace":
            raise UsageError(
                f"engine={self.engine!r} needs a catalog or config model; your own nn.Module "
                "is planned from dry runs (engine='trace')"
            )
        if self.image_size is not None or self.lengths is not None:
            raise UsageError(
                "image_size and lengths are for a catalog or config model; your own "
                "nn.Module's samples are what batch_fn returns"
            )
        if self.global_batch_tokens is not None and self.seq_len is None:
            raise UsageError("global_batch_tokens needs seq_len (tokens per sample)")

    def _check_sample(self) -> None:
        """Tokens for a token model, pixels for an image model, and the sizes the model takes."""
        model = self.model
        if not isinstance(model, ModelInfo):
            return
        if model.task == _IMAGE_TASK:
            _check_image(model, self)
        else:
            _check_tokens(model, self)
        check_workload(model, self.micro_batch_size or 1, self.sample_size)

    def _check_gpu_count(self) -> None:
        count, setup = self.num_gpus, self.setup
        if count == "auto":
            if setup.num_gpus != 1:
                raise UsageError("--num-gpus auto chooses the count: give it without a number")
        elif count is not None:
            if isinstance(count, bool) or not isinstance(count, int) or count < 1:
                raise UsageError(f"--num-gpus must be a positive integer or 'auto', got {count!r}")
            if setup.num_gpus not in (1, count):
                raise UsageError(
                    f"num_gpus={count} and setup.num_gpus={setup.num_gpus} disagree: give the "
                    "count once"
                )
        if self.max_gpus is not None:
            gpu_counts(self.max_gpus)  # 1 to MAX_AUTO_GPUS

    def _check_run_length(self) -> None:
        """The run's length as given: a price needs one; epochs go with a dataset size."""
        price = self.gpu_hour_price
        given = (self.train_tokens, self.train_samples, self.epochs)
        if price is not None and price > 0 and all(length is None for length in given):
            raise UsageError(
                "--gpu-hour-price prices the run: give its length too (--train-tokens N, or "
                "--epochs E --dataset-size N)"
            )
        if (self.epochs is None) != (self.dataset_size is None):
            raise UsageError(
                "--epochs and --dataset-size go together (the run's length in samples)"
            )
        if self.epochs is not None and not self.epochs > 0:  # `not > 0` refuses NaN too
            raise UsageError(f"--epochs must be positive, got {self.epochs}")
        size = self.dataset_size
        if size is not None and (isinstance(size, bool) or not isinstance(size, int)):
            raise UsageError(f"--dataset-size must be a whole number of samples, got {size!r}")
        if self.epochs is not None and size is not None and not math.isfinite(self.epochs * size):
            # the run's samples are a whole number: infinity has none
            raise UsageError(
                f"--epochs x --dataset-size must be a finite number of samples, got "
                f"{self.epochs} x {size}: give a finite --epochs"
            )
        if self.epochs is not None and self.train_samples is not None:
            raise UsageError("give train_samples or epochs with dataset_size, not both")

    def _check_run_size(self) -> None:
        """The run's length in tokens or samples: positive, and one of them. A dataset size
        below 1 shows here as the product's, after the target batch's checks."""
        samples = self.run_samples
        lengths = (("--train-tokens", self.train_tokens), ("--epochs x --dataset-size", samples))
        for name, value in lengths:
            if value is not None and (isinstance(value, bool) or value < 1):
                raise UsageError(f"{name} must be a positive number, got {value}")
        if self.train_tokens is not None and samples is not None:
            raise UsageError("give --train-tokens or --epochs with --dataset-size, not both")

    def _check_batches(self) -> None:
        """The micro-batch against the per-GPU batch; the base LR with its batch."""
        if self.base_batch is not None and self.base_batch_tokens is not None:
            raise UsageError(
                "give --base-batch (samples) or --base-batch-tokens (tokens), not both"
            )
        per_gpu, micro = self.per_gpu_samples, self.micro_batch_size
        if per_gpu > MAX_N:  # the divisor search factors it: keep its cost bounded
            raise UsageError(
                f"{per_gpu:,} samples per GPU per step is past what batchfit plans (2**64); "
                "give a smaller --global-batch or --global-batch-tokens"
            )
        if micro is not None and micro < 1:
            raise UsageError(f"--micro-batch must be positive, got {micro}")
        if micro is not None and per_gpu % micro:
            raise UsageError(
                f"--micro-batch {micro} does not divide the {per_gpu} samples each "
                f"GPU takes per step; try {divisors_near(per_gpu, micro)}"
            )
        if (self.base_lr is None) != (self.base is None):
            raise UsageError(
                "give --base-lr with --base-batch (samples) or --base-batch-tokens (tokens): "
                "the batch the LR was tuned at"
            )
        self._check_accumulation()

    def _check_accumulation(self) -> None:
        """At most ``MAX_ACCUM_STEPS`` micro-batches per step: with ``micro_batch_size`` given,
        exactly; otherwise against the largest micro-batch the GPU could hold if each token
        kept only its 16-bit hidden state (a token model of the catalog)."""
        per_gpu, micro, model = self.per_gpu_samples, self.micro_batch_size, self.model
        if self.num_gpus == "auto":
            per_gpu //= self.max_gpus or DEFAULT_MAX_GPUS
        if micro is None and isinstance(model, ModelInfo) and model.task != _IMAGE_TASK:
            per_sample = 2 * model.arch.hidden_size * max(self.sample_size, 1)
            micro = max(1, self.gpu.memory_bytes // per_sample)
        if micro is not None:
            check_accumulation(self.global_samples, per_gpu // micro)

    def _check_headroom(self) -> None:
        """A size or bytes from 0, less than the GPU's memory; "auto" is checked when read."""
        headroom, gpu = self.headroom_bytes, self.gpu
        if self.headroom_auto:
            return
        if not isinstance(headroom, str) and (
            isinstance(headroom, bool) or not isinstance(headroom, int) or headroom < 0
        ):
            raise UsageError(
                "headroom_bytes must be a whole number of bytes from 0, a size such as '1GiB' "
                f"or 'auto', got {headroom!r}"
            )
        wanted = self.headroom_wanted_bytes
        assert wanted is not None  # not "auto" (returned above)
        if wanted >= gpu.memory_bytes:
            # the size as it was typed, so the message quotes the command line
            shown = headroom if isinstance(headroom, str) else gib(headroom)
            raise UsageError(
                f"--headroom {shown} is all of {gpu.name}'s {gib(gpu.memory_bytes)}: "
                "keep less free, e.g. 0.5GiB"
            )

    # -- what follows from the inputs ------------------------------------------------------

    @property
    def target_model(self) -> ModelInfo | OwnModel:
        """The model as the planner takes it: a catalog model, or your module bundled."""
        if isinstance(self.model, ModelInfo):
            return self.model
        return own_model(self.model, self.batch_fn, self.loss_fn)

    @property
    def sample_size(self) -> int:
        """Tokens per sample, or an image model's side in pixels (0: your module, no tokens)."""
        model = self.model
        if isinstance(model, ModelInfo) and model.task == _IMAGE_TASK:
            return self.image_size if self.image_size is not None else model.arch.image_size
        if self.lengths is not None:
            return self.lengths.seq_len
        return self.seq_len or 0

    @property
    def headroom_auto(self) -> bool:
        """Whether the headroom is ``"auto"`` (any case, spaces around it allowed)."""
        headroom = self.headroom_bytes
        return isinstance(headroom, str) and headroom.strip().lower() == "auto"

    @property
    def headroom_wanted_bytes(self) -> int | None:
        """The headroom in bytes (a size parsed); None for ``"auto"``, which ``make_plan``
        resolves from the calibration records."""
        headroom = self.headroom_bytes
        if not isinstance(headroom, str):
            return headroom
        if self.headroom_auto:
            return None
        return parse_size(headroom, what="--headroom", allow_zero=True)

    @property
    def gpu_count(self) -> int:
        """GPUs of the plan: the setup's (1 while ``num_gpus="auto"`` has not chosen)."""
        return self.num_gpus if isinstance(self.num_gpus, int) else self.setup.num_gpus

    @property
    def global_samples(self) -> int:
        """The global batch in samples (``samples_from_target``)."""
        return samples_from_target(
            self.global_batch, self.global_batch_tokens, self.sample_size, self.gpu_count
        )

    @property
    def per_gpu_samples(self) -> int:
        return self.global_samples // self.gpu_count

    @property
    def run_samples(self) -> int | None:
        """Samples of the whole run: ``train_samples``, or ``epochs`` x ``dataset_size``."""
        if self.epochs is not None and self.dataset_size is not None:
            return math.ceil(self.epochs * self.dataset_size)
        return self.train_samples

    @property
    def train_steps(self) -> int | None:
        """Optimizer steps of the run: its tokens (or samples) over the global batch."""
        if self.train_tokens is not None:
            # the dataset's tokens: under dynamic padding a sample brings the mean length
            per_sample = self.lengths.tokens_per_sample if self.lengths else self.sample_size
            return math.ceil(self.train_tokens / (self.global_samples * (per_sample or 1)))
        if self.run_samples is not None:
            return -(-self.run_samples // self.global_samples)
        return None

    @property
    def price(self) -> GpuHourPrice | None:
        """The GPU-hour price: the one given, else the catalog's (``plan/_prices.py``)."""
        return _hour_price(self.gpu_hour_price, self.gpu.name)

    @property
    def base(self) -> tuple[float, str] | None:
        """The batch the LR was tuned at, as (size, "samples" or "tokens")."""
        if self.base_batch is not None:
            return (self.base_batch, "samples")
        if self.base_batch_tokens is not None:
            return (self.base_batch_tokens, "tokens")
        return None

    @property
    def critical(self) -> tuple[float, str] | None:
        """The critical batch as (size, unit), the LR options checked (``lr_options``)."""
        return lr_options(
            self.base_lr,
            self.base_betas,
            self.base_eps,
            self.critical_batch,
            self.critical_batch_tokens,
        )

    @property
    def target_batch(self) -> tuple[int, str]:
        """The global batch in the unit it was asked in: (size, "samples" or "tokens")."""
        if self.global_batch_tokens is not None:
            return (self.global_batch_tokens, "tokens")
        return (self.global_samples, "samples")

    @property
    def run_setup(self) -> TrainingSetup:
        """``setup`` with the plan's GPU count."""
        if self.setup.num_gpus == self.gpu_count:
            return self.setup
        return replace(self.setup, num_gpus=self.gpu_count)


def _check_image(model: ModelInfo, request: PlanRequest) -> None:
    if request.seq_len is not None or request.lengths is not None:
        given = "--seq-len" if request.seq_len is not None else "--lengths/--padding"
        raise UsageError(
            f"{given} counts tokens; {model.name} is an image model: give --image-size PIXELS"
        )
    if request.global_batch_tokens is not None:
        raise UsageError(
            f"--global-batch-tokens counts tokens; {model.name} sees images: give --global-batch"
        )
    if request.sample_size < 1:
        raise UsageError(
            f"--image-size must be a positive number of pixels, got {request.sample_size}"
        )


def _check_tokens(model: ModelInfo, request: PlanRequest) -> None:
    if request.image_size is not None:
        raise UsageError(
            f"--image-size is for image models; {model.name} reads tokens: give --seq-len"
        )
    lengths = request.lengths
    if lengths is None:
        if request.seq_len is None:
            raise UsageError("make_plan needs seq_len for a catalog or config model")
        return
    if request.seq_len is not None and request.seq_len != lengths.seq_len:
        raise UsageError(
            f"seq_len {request.seq_len} and lengths (planned at {lengths.seq_len} tokens) "
            "disagree: give lengths alone (batchfit.lengths.workload(files, padding, seq_len) "
            "truncates at seq_len)"
        )
    if lengths.padding == "longest" and request.global_batch_tokens is not None:
        raise UsageError(
            "--global-batch-tokens needs a fixed number of tokens per sample, and with dynamic "
            "padding (--padding longest) a step's tokens vary: give --global-batch in samples, "
            "or --padding packed (or max) with --seq-len"
        )


def samples_from_target(
    global_batch: int | None, global_batch_tokens: int | None, seq_len: int, num_gpus: int
) -> int:
    """The global batch in samples; exact or a UsageError naming the nearest reachable ones."""
    if (global_batch is None) == (global_batch_tokens is None):
        raise UsageError("give exactly one of --global-batch (samples) or --global-batch-tokens")
    if global_batch is not None:
        if global_batch < 1:
            raise UsageError(f"--global-batch must be positive, got {global_batch}")
        if global_batch % num_gpus:
            raise UsageError(
                f"--global-batch {global_batch} cannot be split evenly over {num_gpus} GPUs; "
                f"nearest reachable: {_nearest(global_batch, num_gpus)}, or --num-gpus "
                f"{divisors_near(global_batch, num_gpus)}"
            )
        return global_batch
    assert global_batch_tokens is not None  # exactly one was given (checked above)
    if global_batch_tokens < 1:
        raise UsageError(f"--global-batch-tokens must be positive, got {global_batch_tokens}")
    unit = seq_len * num_gpus
    if global_batch_tokens % unit:
        samples = global_batch_tokens // seq_len if global_batch_tokens % seq_len == 0 else 0
        world = f", or --num-gpus {divisors_near(samples, num_gpus)}" if samples else ""
        raise UsageError(
            f"--global-batch-tokens {global_batch_tokens} is not a multiple of seq-len x GPUs "
            f"= {unit}; nearest reachable: {_nearest(global_batch_tokens, unit)} tokens{world}"
        )
    return global_batch_tokens // seq_len


def _nearest(value: int, unit: int) -> str:
    lo = value // unit * unit
    options = [v for v in (lo, lo + unit) if v > 0]
    return " or ".join(f"{v:,}" for v in options)
