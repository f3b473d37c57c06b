"""The ``batchfit estimate`` options that reproduce one option of a plan (``estimate_args``)."""

from __future__ import annotations

from batchfit.spec import TrainingSetup


def estimate_args(
    model: str,
    gpu: str,
    seq_len: int,
    setup: TrainingSetup,
    micro_batch_size: int,
    grad_accum_steps: int,
    engine: str,
) -> list[str]:
    """``estimate``'s arguments for ``setup`` at ``micro_batch_size``: its figure is the
    option's, and it fits when the option says so (``headroom_bytes`` at least the plan's
    ``headroom_wanted_bytes``).

    Example:
        >>> estimate_args("gpt2", "t4", 1024, TrainingSetup(grad_ckpt=True), 8, 4, "analytic")[:8]
        ['gpt2', '--gpu', 't4', '--seq-len', '1024', '--micro-batch', '8', '--grad-accum']
    """
    args = [model, "--gpu", gpu, "--seq-len", str(seq_len)]
    args += ["--micro-batch", str(micro_batch_size), "--grad-accum", str(grad_accum_steps)]
    args += ["--num-gpus", str(setup.num_gpus), "--engine", engine]
    if setup.framework:
        args += ["--framework", setup.framework]
    if setup.task:
        args += ["--task", setup.task]
    if setup.grad_ckpt_every is not None:
        args += ["--grad-ckpt-every", str(setup.grad_ckpt_every)]
    else:
        args.append("--grad-ckpt" if setup.grad_ckpt else "--no-grad-ckpt")
    for flag, value in (
        ("--loss", setup.loss_label),
        ("--attention", setup.attention),
        ("--loop", setup.loop),
        ("--method", setup.method),
        ("--precision", setup.precision),
        ("--optimizer", setup.optimizer),
        ("--optimizer-impl", setup.optimizer_impl),
        ("--sharding", setup.sharding),
        ("--offload", setup.offload),
    ):
        args += [flag, str(value)]
    if setup.is_lora:
        args += ["--lora-rank", str(setup.lora_rank), "--lora-alpha", str(setup.lora_alpha)]
        args += ["--lora-dropout", str(setup.lora_dropout)]
        args += ["--lora-dtype", setup.lora_dtype, "--frozen-dtype", setup.frozen_dtype]
        if setup.lora_targets:
            args += ["--lora-targets", ",".join(setup.lora_targets)]
    if setup.expandable_segments:
        args.append("--expandable-segments")
    return args
