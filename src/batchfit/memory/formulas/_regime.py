"""The element sizes a precision setup gives activations (compute, residual stream)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Regime:
    """Element sizes of one precision setup."""

    compute_bytes: int  # linear outputs: 2 under autocast or pure 16-bit, 4 in fp32
    stream_bytes: int  # the residual stream: fp32 under autocast (fp32 weights), else the dtype
    amp: bool
    cuda_autocast: bool = False  # CUDA's autocast runs pow / exp / softmax ... in fp32
    # the MLP's intermediates (gate, act, up) when not ``compute_bytes``: fp32 under autocast
    # when the 4-bit layers take an fp32 stream (QLoRA after prepare_model_for_kbit_training)
    mlp_bytes: int | None = None

    @classmethod
    def of(cls, precision: str, device: str = "cuda") -> Regime:
        if precision == "fp32":
            return cls(4, 4, False)
        if precision.startswith("amp-"):
            return cls(2, 4, True, device == "cuda")
        return cls(2, 2, False)
