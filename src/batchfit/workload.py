"""``Workload``: the size of one training step and where it runs, checked once.

Every engine (formulas, dry run, step time) and the planner read the same few quantities: the
samples in a micro-batch, the size of one sample, the device and its GPU, and the micro-steps
accumulated per optimizer step. They travel as one validated value rather than loose arguments.

One sample's size is one field, ``seq_len``: tokens for a token model, the image side in pixels
for an image model (``--image-size``). The model, not the workload, says which it counts, as
``MemoryEstimate.seq_len`` and ``PlanRequest.sample_size`` do; a separate ``image_size`` field
would make every engine pick one of two fields and allow a workload with both or neither.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, get_args

from batchfit.errors import UsageError
from batchfit.hardware import GpuSpec
from batchfit.lengths import LengthsSummary

Device = Literal["cpu", "cuda"]
DEVICES: tuple[str, ...] = get_args(Device)


def _is_positive_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


@dataclass(frozen=True)
class Workload:
    """One training step's size and device.

    Attributes:
        micro_batch_size: Samples in one micro-batch (``--micro-batch``).
        seq_len: One sample's size: tokens (``--seq-len``), or for an image model the image
            side in pixels (``--image-size``).
        device: ``"cuda"`` or ``"cpu"`` (``--device``).
        gpu: The GPU, on ``"cuda"`` only (``--gpu``); None on ``"cuda"``: the CUDA costs of
            an Ampere card, and no step time.
        grad_accum_steps: Micro-steps per optimizer step (``--grad-accum``).
        lengths: What a dataset's lengths say (``--lengths``); its ``seq_len`` is this one.

    Example:
        >>> from batchfit.hardware import get_gpu
        >>> w = Workload(micro_batch_size=8, seq_len=512, gpu=get_gpu("a100-80gb"))
        >>> w.device, w.grad_accum_steps
        ('cuda', 1)
        >>> Workload(micro_batch_size=0, seq_len=512)
        Traceback (most recent call last):
        ...
        batchfit.errors.UsageError: micro_batch_size must be a positive integer, got 0

    Raises:
        UsageError: a field out of range, in one line naming its option.
    """

    micro_batch_size: int
    seq_len: int
    device: Device = "cuda"
    gpu: GpuSpec | None = None
    grad_accum_steps: int = 1
    lengths: LengthsSummary | None = None

    def __post_init__(self) -> None:
        if not _is_positive_int(self.micro_batch_size):
            raise UsageError(
                f"--micro-batch must be a positive integer, got {self.micro_batch_size!r}"
            )
        if not _is_positive_int(self.seq_len):
            raise UsageError(f"--seq-len must be a positive integer, got {self.seq_len!r}")
        if not isinstance(self.device, str) or self.device not in DEVICES:
            raise UsageError(f"--device {self.device!r} is not one of: {', '.join(DEVICES)}")
        if self.gpu is not None and not isinstance(self.gpu, GpuSpec):
            raise UsageError(f"--gpu must be a GpuSpec (batchfit.get_gpu(NAME)), got {self.gpu!r}")
        if self.gpu is not None and self.device == "cpu":
            raise UsageError("--gpu and --device cpu contradict each other: drop one")
        if not _is_positive_int(self.grad_accum_steps):
            raise UsageError(
                f"--grad-accum must be a positive integer, got {self.grad_accum_steps!r}"
            )
        self._check_lengths()

    def _check_lengths(self) -> None:
        if self.lengths is None:
            return
        if not isinstance(self.lengths, LengthsSummary):
            raise UsageError(
                "--lengths must be a LengthsSummary (batchfit.lengths.workload(files, padding, "
                f"seq_len)), got {self.lengths!r}"
            )
        if self.lengths.seq_len != self.seq_len:
            raise UsageError(
                f"--seq-len {self.seq_len} and --lengths (planned at {self.lengths.seq_len} "
                "tokens) disagree: memory is planned for the lengths' worst micro-batch"
            )
