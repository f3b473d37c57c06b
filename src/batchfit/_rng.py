"""``RngState``: every global random state a training step draws from, to put it back.

One snapshot for the two places that redo or undo steps: the batch-size search (a probe must
leave the caller's random state as it found it) and ``MicroBatcher`` (a global batch redone
after an out-of-memory error must draw what a run at the smaller size would have drawn).
"""

from __future__ import annotations

import random
import sys
from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True)
class RngState:
    """Python's, numpy's, torch's CPU and CUDA random states at one moment.

    numpy's global state is taken only when numpy is already imported: until then nothing can
    have drawn from it, and importing it here would cost every caller the import. The CUDA
    states (one per device) only when CUDA is initialised, for the same reason: capturing
    would initialise it. A capture costs tens of KB of host memory (Python's Mersenne Twister
    state is 625 ints; torch's CPU state is 5 KB, each device's a few bytes).

    Example:
        >>> import random
        >>> state = RngState.capture()
        >>> first = (random.random(), float(torch.rand(1)))
        >>> state.restore()
        >>> (random.random(), float(torch.rand(1))) == first
        True
    """

    python: tuple[Any, ...]
    numpy: Any | None  # numpy.random.get_state() of the legacy global generator
    torch_cpu: torch.Tensor
    cuda: tuple[torch.Tensor, ...] | None

    @classmethod
    def capture(cls) -> RngState:
        """The random states now."""
        numpy = sys.modules.get("numpy")
        initialised = torch.cuda.is_initialized()  # type: ignore[no-untyped-call, unused-ignore]
        cuda = tuple(torch.cuda.get_rng_state_all()) if initialised else None
        return cls(
            python=random.getstate(),
            numpy=numpy.random.get_state() if numpy is not None else None,
            torch_cpu=torch.get_rng_state(),
            cuda=cuda,
        )

    def restore(self) -> None:
        """Put every captured state back (a state not captured is left as it is)."""
        random.setstate(self.python)
        numpy = sys.modules.get("numpy")
        if numpy is not None and self.numpy is not None:
            numpy.random.set_state(self.numpy)
        torch.set_rng_state(self.torch_cpu)
        if self.cuda is not None:
            torch.cuda.set_rng_state_all(list(self.cuda))
