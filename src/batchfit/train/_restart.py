"""What a global batch started with and a redo after an OOM puts back: RNG state, buffers."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from batchfit._rng import RngState

# Buffers a forward pass may update in place: running statistics (float), batch counts (int).
_BUFFER_DTYPES = frozenset(
    {torch.float64, torch.float32, torch.float16, torch.bfloat16}
    | {torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8}
)


@dataclass(frozen=True)
class BatchStart:
    """What a global batch started with and a redo puts back: random state and buffers."""

    rng: RngState
    buffers: dict[str, torch.Tensor]  # name -> copy, on the buffer's device

    @classmethod
    def capture(cls, model: torch.nn.Module) -> BatchStart:
        with torch.no_grad():
            buffers = {
                name: buf.clone()
                for name, buf in model.named_buffers()
                if buf.dtype in _BUFFER_DTYPES
            }
        return cls(rng=RngState.capture(), buffers=buffers)

    def restore(self, model: torch.nn.Module) -> None:
        # In place: DDP holds references to the buffer tensors it broadcasts.
        live = dict(model.named_buffers())
        with torch.no_grad():
            for name, saved in self.buffers.items():
                live[name].copy_(saved)
        self.rng.restore()
