"""The plan's warnings: what does not fit, how to switch on what the plan chose, what the run
needs besides the GPU (host RAM), and a run shorter than one batch."""

from __future__ import annotations

from batchfit._batchnorm import batchnorm_warning
from batchfit._units import human_bytes, ordinal
from batchfit.hardware import GpuSpec
from batchfit.memory.types import MemoryEstimate
from batchfit.models import ModelInfo
from batchfit.plan._choice import MAX_QUIET_ACCUM
from batchfit.plan._ladder import Combo
from batchfit.plan._own import OwnModel
from batchfit.plan._target import _Fit
from batchfit.spec import TrainingSetup


def fit_warnings(gpu: GpuSpec, wanted: int | None, fit: _Fit) -> list[str]:
    best = fit.max_micro_batch
    if best == 0:
        return [
            f"nothing fits on {gpu.name}, with or without the techniques on the ladder: "
            "more GPUs (--num-gpus with --sharding zero3), a shorter --seq-len or a smaller "
            "model are needed; the figures show by how much it misses"
        ]
    if wanted is not None and wanted > best:
        names = ", ".join(t.name for t in fit.techniques)
        # an option that fits it but needs code the framework's config cannot switch on
        coded = next((a for a in fit.alternatives if a.needs and a.max_micro_batch >= wanted), None)
        with_code = (
            f"; {' + '.join(t.name for t in coded.techniques)} (needs code) fits it"
            if coded is not None
            else ""
        )
        return [
            f"--micro-batch {wanted} does not fit even with the ladder's techniques the "
            f"framework switches on; {best} is the largest that fits"
            + (f" (with {names})" if names else "")
            + with_code
        ]
    return []


def ckpt_warnings(setup: TrainingSetup, model: ModelInfo | OwnModel) -> list[str]:
    """How to checkpoint the layers a partial-checkpointing plan chose."""
    every = setup.grad_ckpt_every
    if every is None or not isinstance(model, ModelInfo):
        return []
    layers = model.arch.num_layers
    return [
        f"the plan checkpoints every {ordinal(every)} layer "
        f"({setup.checkpointed_layers(layers)} of {layers}: layers {every - 1}, "
        f"{2 * every - 1}, ...): wrap those layers with "
        f"torch.utils.checkpoint (torchtune: ac_mode selective, ac_option {every})"
    ]


def _has_batchnorm(model: ModelInfo | OwnModel) -> bool:
    if isinstance(model, OwnModel):
        return model.has_batchnorm()
    return any("batchnorm" in g.module.lower() for g in model.params)


def advice_warnings(
    model: ModelInfo | OwnModel, gpu: GpuSpec, setup: TrainingSetup, micro: int, accum: int
) -> list[str]:
    warnings = []
    if accum > MAX_QUIET_ACCUM:
        warnings.append(
            f"{accum} accumulation steps: each optimizer step runs {accum} "
            "forward/backward passes; more GPUs would shorten it"
        )
    precision = setup.resolved(device="cuda", bf16_supported=gpu.bf16).precision
    if precision in ("fp16", "amp-fp16"):
        warnings.append(
            "fp16 needs a GradScaler (loss scaling); bf16 does not"
            + ("" if gpu.bf16 else f" but {gpu.name} has no bf16")
        )
    batchnorm = batchnorm_warning(micro)
    if batchnorm and _has_batchnorm(model):
        warnings.append(batchnorm)
    return warnings


def loss_warnings(techniques: Combo, setup: TrainingSetup) -> list[str]:
    """How to switch on the lean loss the plan chose (not one the user or framework set)."""
    names = {t.name for t in techniques}
    if "chunked-loss" in names:
        return [
            f"the plan assumes a chunked loss ({setup.loss_label}): HF Trainer has no switch for "
            "it (torchtune's LinearCrossEntropyLoss or axolotl's chunked_cross_entropy: true do "
            "it; in a Trainer, override compute_loss); --loss full keeps the full loss"
        ]
    if "fused-loss" in names:
        return [
            "the plan assumes Liger's fused linear cross-entropy: pip install liger-kernel (the "
            "HF export sets use_liger_kernel); --loss full keeps the full loss"
        ]
    return []


# host RAM for offloaded state worth a line of its own (the breakdown table shows any)
HOST_RAM_WARNING_BYTES = 32 * 2**30


def host_warnings(est: MemoryEstimate, num_gpus: int) -> list[str]:
    """The host RAM an offloading plan needs, when it is more than many machines have."""
    if est.host_bytes < HOST_RAM_WARNING_BYTES:
        return []
    each = human_bytes(est.host_bytes)
    total = f" ({human_bytes(est.host_bytes * num_gpus)} for {num_gpus} GPUs on one machine)"
    return [
        f"the offloaded state needs {each} of host RAM per GPU process"
        + (total if num_gpus > 1 else "")
        + ", besides the data loader's: check `free -g` on the training machine"
    ]


def short_run_warnings(
    tokens: int | None, samples: int | None, global_samples: int, seq_len: int
) -> list[str]:
    """A run shorter than one global batch (its one step is a whole batch)."""
    batch_tokens = global_samples * seq_len
    if tokens is not None and tokens < batch_tokens:
        return [
            f"--train-tokens {tokens:,} is less than one global batch ({batch_tokens:,} "
            "tokens): the run is 1 optimizer step of a whole batch"
        ]
    if samples is not None and samples < global_samples:
        return [
            f"--epochs x --dataset-size gives {samples:,} samples, less than one global batch "
            f"({global_samples:,}): the run is 1 optimizer step of a whole batch"
        ]
    return []
