"""What QLoRA's recipe and bitsandbytes leave unquantised, and in which dtype: the notes both
engines print with a QLoRA estimate."""

from __future__ import annotations

from batchfit.models import ModelInfo
from batchfit.spec import TrainingSetup


def qlora_notes(model: ModelInfo, setup: TrainingSetup) -> list[str]:
    """The recipe's preparation (the fp32 cast, checkpointing on by default) and the MoE
    experts bitsandbytes does not quantise; [] unless ``setup`` is QLoRA."""
    if setup.method != "qlora":
        return []
    notes = []
    experts = model.fused_expert_params()
    kept = "fp32" if setup.kbit_upcast else "16-bit"
    if setup.kbit_upcast:
        rest = model.total_params - model.quantizable_params()
        notes.append(
            f"QLoRA recipe: peft's prepare_model_for_kbit_training casts the {rest:,} parameters "
            "left unquantised (embeddings, norms, output head"
            + (", fused MoE experts" if experts else "")
            + ") to fp32; the 4-bit layers then take fp32 inputs and return fp32 outputs"
        )
        if not setup.grad_ckpt:
            notes.append(
                "QLoRA recipe: prepare_model_for_kbit_training switches gradient checkpointing "
                "on unless told not to (use_gradient_checkpointing=True): add --grad-ckpt to "
                "estimate that run"
            )
    if experts:
        share = experts / max(1, model.total_params)
        notes.append(
            f"QLoRA on MoE: the fused expert tensors ({share:.0%} of the weights) are 3-D "
            "parameters, not nn.Linear layers: transformers' replace_with_bnb_linear quantises "
            f"nn.Linear and Conv1D only, so they stay {kept} "
            "(bitsandbytes-foundation/bitsandbytes#1849)"
        )
    return notes
