"""One trial of the search being run: real steps of one size, an out-of-memory error caught,
the peak and the speed measured, every verdict agreed between ranks."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from batchfit._memwatch import MemoryWatch
from batchfit._oom import is_oom, release_memory
from batchfit.errors import UsageError
from batchfit.train import batch_len


class TrialRun:
    """Steps of size ``n``, which can be added to until the trial is recorded.

    ``clock`` times the steps (``time.perf_counter``; a test injects its own).
    """

    def __init__(
        self, n: int, watch: MemoryWatch, clock: Callable[[], float] = time.perf_counter
    ) -> None:
        self.n, self.watch, self.clock = n, watch, clock
        self.begin = clock()
        self.timed: list[float] = []
        self.done = 0
        self.peak: int | None = None
        self.error: str | None = None
        watch.reset_peak()

    @property
    def ok(self) -> bool:
        return self.error is None

    def steps(
        self, step_fn: Callable[[Any], Any], make_batch: Callable[[int], Any], k: int
    ) -> None:
        """Run ``k`` more steps; every step after the trial's first is timed."""
        error: str | None = None
        try:
            for _ in range(k):
                batch = make_batch(self.n)
                _check_batch(batch, self.n)
                t0 = self.clock()
                step_fn(batch)
                self.watch.synchronize()
                if self.done > 0:
                    self.timed.append(self.clock() - t0)
                self.done += 1
                del batch
        except Exception as e:  # re-raised below unless it is an out-of-memory error
            if not is_oom(e):
                raise
            error = str(e).strip().splitlines()[0][:200] if str(e).strip() else type(e).__name__
        # Outside the except block: its traceback no longer holds the failed step's tensors.
        if not self.watch.agree(error is None):
            self.error = error or "out of memory on another rank"
            self.watch.drop_gradients()
            release_memory()
            return
        self.peak = self.watch.peak_bytes()

    def samples_per_s(self) -> float | None:
        """Over the timed steps, as fast as the slowest rank; None: none timed, or it failed."""
        if not (self.ok and self.timed and sum(self.timed) > 0):
            return None
        return self.watch.agree_speed(self.n * len(self.timed) / sum(self.timed))

    def seconds(self) -> float:
        return self.clock() - self.begin


def _check_batch(batch: Any, n: int) -> None:
    """Refuse a batch of another size than asked: the trial would report a size that never ran
    (a dataset shorter than the size, sliced, gives all it has)."""
    try:
        got = batch_len(batch)
    except ValueError:  # not a batch batch_len can count (a custom object): nothing to check
        return
    if got != n:
        fix = f"pass high={got} (the data holds no more)" if got < n else "return n samples"
        raise UsageError(
            f"make_batch({n}) gave {got} samples (counted along dim 0, as MicroBatcher splits "
            f"batches): a size is reported only when it ran; {fix}"
        )
