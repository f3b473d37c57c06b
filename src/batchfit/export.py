"""Turn a plan into configs people paste: HF TrainingArguments, DeepSpeed, accelerate, Lightning."""

from __future__ import annotations

import json
import os
import secrets
from dataclasses import replace
from pathlib import Path
from typing import Any

from batchfit._units import ordinal
from batchfit.errors import UsageError
from batchfit.memory.formulas.deepspeed import precision_config, zero_optimization
from batchfit.optimizers import get_optimizer
from batchfit.plan import Plan
from batchfit.spec import TrainingSetup, is_deepspeed
from batchfit.speed import GPUS_PER_NODE

EXPORT_KINDS: tuple[str, ...] = ("hf", "deepspeed", "accelerate", "lightning")

_PEFT_TASK = {
    "causal-lm": "CAUSAL_LM",
    "classification": "SEQ_CLS",
    "masked-lm": "FEATURE_EXTRACTION",
    "seq2seq": "SEQ_2_SEQ_LM",
}


def _zero_stage(setup: TrainingSetup) -> int:
    return {"zero1": 1, "zero2": 2, "zero3": 3, "fsdp": 3}.get(setup.sharding, 0)


def _peft_settings(plan: Plan) -> dict[str, Any]:
    setup = plan.setup
    out: dict[str, Any] = {}
    if setup.is_lora:
        out["lora_config"] = {
            "r": setup.lora_rank,
            "lora_alpha": setup.lora_alpha,
            "lora_dropout": setup.lora_dropout,
            "target_modules": list(plan.lora_targets),
            "task_type": _PEFT_TASK[plan.task],
        }
    if setup.method == "qlora":
        out["bnb_config"] = {
            "load_in_4bit": True,
            "bnb_4bit_quant_type": "nf4",
            "bnb_4bit_use_double_quant": True,
            "bnb_4bit_compute_dtype": "float16" if setup.precision.endswith("fp16") else "bfloat16",
        }
    # fp16 with an fp32 master copy is DeepSpeed's job: it casts the model itself.
    if setup.precision == "bf16" or (setup.is_lora and setup.precision not in ("fp32", "fp16")):
        out["from_pretrained_kwargs"] = {
            "torch_dtype": "float16" if setup.precision.endswith("fp16") else "bfloat16"
        }
    if setup.method == "qlora" and setup.sharding == "fsdp":
        # FSDP flattens a module's parameters into one tensor of one float dtype: the 4-bit codes
        # must be stored in the dtype the rest of the model loads in, not uint8 (bitsandbytes
        # docs, "FSDP-QLoRA": quant_storage = torch_dtype; PEFT's fsdp-qlora recipe does the same)
        loaded = out.get("from_pretrained_kwargs", {}).get("torch_dtype", "float32")
        out["bnb_config"]["bnb_4bit_quant_storage"] = loaded
    return out


def hf_training_arguments(plan: Plan) -> dict[str, Any]:
    """Keyword arguments for ``transformers.TrainingArguments``."""
    setup = plan.setup
    names = get_optimizer(setup.optimizer).export
    kwargs: dict[str, Any] = {
        "output_dir": "out",
        "per_device_train_batch_size": plan.micro_batch_size,
        "gradient_accumulation_steps": plan.grad_accum_steps,
        "optim": names.hf_optim,  # the fused implementation: below
        # `activation_checkpointing`: transformers 5.x deprecates `gradient_checkpointing` for it
        "activation_checkpointing": setup.grad_ckpt,
        "bf16": setup.precision in ("amp-bf16", "bf16"),
        "fp16": setup.precision in ("amp-fp16", "fp16"),
    }
    if setup.loss == "fused":
        # Trainer patches the model with Liger's kernels, fused linear cross-entropy among them
        # (trainer.py: _apply_liger_kernel_to_instance); needs `pip install liger-kernel`.
        kwargs["use_liger_kernel"] = True
    if names.hf_optim is None:  # transformers has no name: export_caveats says what to do
        del kwargs["optim"]
    if names.hf_optim_fused is not None and setup.optimizer_impl == "fused":
        kwargs["optim"] = names.hf_optim_fused  # the plan counted the fused kernel's memory
    if names.hf_optim_args is not None:
        kwargs["optim_args"] = names.hf_optim_args
    # The same decay the DeepSpeed export writes: Trainer refuses configs that disagree.
    kwargs["weight_decay"] = names.weight_decay
    if plan.learning_rate is not None:
        kwargs["learning_rate"] = plan.learning_rate
    # fp16 weights training against an fp32 master copy: DeepSpeed (stage 0 is enough) does it;
    # a plain Trainer's GradScaler refuses fp16 parameters.
    # The DeepSpeed config goes inline (TrainingArguments takes a dict): no second file to write.
    if setup.sharding in ("zero1", "zero2", "zero3") or setup.precision == "fp16":
        kwargs["deepspeed"] = deepspeed_config(plan)
    elif setup.sharding == "fsdp":
        # fsdp=True + fsdp_config: the string form ("full_shard auto_wrap offload") is deprecated.
        # FSDP2's reshard_after_forward=True is full_shard; auto_wrap is its default policy.
        version = setup.fsdp_version or 2
        kwargs["fsdp"] = True
        kwargs["fsdp_config"] = {
            # transformers 5.24 training_args.py:2826 reads the version (default 2)
            "version": version,
            # :2869 FSDP1 takes the sharding strategy's name here; :2875 backward_prefetch
            "reshard_after_forward": True if version == 2 else "full_shard",
            "cpu_offload": setup.offload != "none",
        }
        if version == 1:  # as the plan traced it (accelerate's config keys, without fsdp_)
            kwargs["fsdp_config"] |= {"backward_prefetch": "backward_pre", "use_orig_params": True}
    return kwargs


def _as_deepspeed(setup: TrainingSetup) -> TrainingSetup:
    """``setup`` as DeepSpeed would run it: FSDP's full sharding is ZeRO-3."""
    stage = _zero_stage(setup)
    return replace(setup, sharding=f"zero{stage}") if stage else setup  # type: ignore[arg-type]


def deepspeed_config(plan: Plan) -> dict[str, Any]:
    """A DeepSpeed config; ``train_batch_size`` = micro x accumulation x world size.

    The ZeRO section and the precision come from ``memory.formulas.deepspeed``, the module that
    counts the plan's memory: the buckets written here are the buckets counted there.
    """
    setup = _as_deepspeed(plan.setup)
    config: dict[str, Any] = {
        "train_batch_size": plan.global_batch_size,
        "train_micro_batch_size_per_gpu": plan.micro_batch_size,
        "gradient_accumulation_steps": plan.grad_accum_steps,
        "zero_optimization": zero_optimization(setup),
        **precision_config(setup),
        "gradient_clipping": 1.0,
    }
    names = get_optimizer(setup.optimizer).export
    if names.deepspeed_type is not None:
        params: dict[str, Any] = {"weight_decay": names.weight_decay}
        if plan.learning_rate is not None:
            params["lr"] = plan.learning_rate
        config["optimizer"] = {"type": names.deepspeed_type, "params": params}
    return config


def accelerate_config(plan: Plan) -> dict[str, Any]:
    """An accelerate config (the YAML ``accelerate config`` writes), as a dict."""
    setup = plan.setup
    mixed = {"amp-bf16": "bf16", "bf16": "bf16", "amp-fp16": "fp16", "fp16": "fp16"}.get(
        setup.precision, "no"
    )
    config: dict[str, Any] = {
        "compute_environment": "LOCAL_MACHINE",
        "debug": False,
        "machine_rank": 0,
        "num_machines": nodes_of(plan.num_gpus)[0],
        "num_processes": plan.num_gpus,  # all machines' together
        "mixed_precision": mixed,
        "use_cpu": False,
        "main_training_function": "main",
        "rdzv_backend": "static",
        "same_network": True,
        "gpu_ids": "all",
    }
    if setup.sharding in ("zero1", "zero2", "zero3"):
        config["distributed_type"] = "DEEPSPEED"
        config["deepspeed_config"] = {
            "gradient_accumulation_steps": plan.grad_accum_steps,
            "gradient_clipping": 1.0,
            "zero_stage": _zero_stage(setup),
            "offload_optimizer_device": "cpu" if setup.offload != "none" else "none",
            "offload_param_device": "cpu" if setup.offload == "optimizer+params" else "none",
            "zero3_init_flag": setup.sharding == "zero3",
        }
    elif setup.sharding == "fsdp":
        config["distributed_type"] = "FSDP"
        config["fsdp_config"] = {
            **_accelerate_fsdp_layout(setup.fsdp_version or 2),
            "fsdp_auto_wrap_policy": "TRANSFORMER_BASED_WRAP",
            "fsdp_offload_params": setup.offload != "none",
            "fsdp_state_dict_type": "SHARDED_STATE_DICT",
            "fsdp_activation_checkpointing": setup.grad_ckpt,
        }
    else:
        config["distributed_type"] = "MULTI_GPU" if plan.num_gpus > 1 else "NO"
    return config


def _accelerate_fsdp_layout(version: int) -> dict[str, Any]:
    """The FSDP version and the wrapping the plan traced, as accelerate's config spells them."""
    if version == 2:
        # FSDP2 (accelerate 1.15 FullyShardedDataParallelPlugin, fsdp_version=2): a bool
        # reshard_after_forward replaces FSDP1's sharding strategy (True = FULL_SHARD)
        return {"fsdp_version": 2, "fsdp_reshard_after_forward": True}
    # FSDP1: accelerate 1.15 utils/dataclasses.py:1892 and :1938 default backward_prefetch to
    # none and use_orig_params to False; the trace runs BACKWARD_PRE and the original parameters
    return {
        "fsdp_version": 1,
        "fsdp_sharding_strategy": "FULL_SHARD",
        "fsdp_backward_prefetch": "BACKWARD_PRE",
        "fsdp_use_orig_params": True,
    }


def launch_command(plan: Plan, kind: str | None = None, config_path: str | None = None) -> str:
    """The command line that runs the plan's setup on its GPUs (``train.py`` is your script).

    The launcher follows the export (``kind``), and names a config file only where one was
    exported for it to read (``config_path``, or the file's default name):

    - ``accelerate``: ``accelerate launch --config_file FILE``; the YAML carries DeepSpeed or FSDP.
    - ``deepspeed``: ``deepspeed --num_gpus N train.py --deepspeed FILE``; the JSON is the config.
    - ``hf``: ``torchrun --nproc-per-node N`` (``python`` on one GPU without DeepSpeed or FSDP):
      the DeepSpeed dict or the FSDP settings ride inside ``TrainingArguments``, which the
      Trainer reads in every process, so no launcher needs a file.
    - ``lightning``: ``python train.py``: the Trainer's strategy (``ddp``, ``fsdp``,
      ``deepspeed_stage_N``) starts its ``devices`` processes itself.
    - none: the launcher of the plan's own setup (ZeRO: ``deepspeed`` with ``ds_config.json``,
      FSDP2: ``accelerate launch`` with ``accelerate.yaml``, DDP: ``torchrun``), for the file
      ``--export deepspeed|accelerate`` would write.

    Example:
        >>> from batchfit.models import resolve_model
        >>> from batchfit.hardware import get_gpu
        >>> from batchfit.plan import make_plan
        >>> p = make_plan(resolve_model("gpt2"), get_gpu("a100-40gb"),
        ...               TrainingSetup(num_gpus=4, sharding="zero2"), seq_len=1024,
        ...               global_batch=64, engine="analytic")
        >>> launch_command(p)
        'deepspeed --num_gpus 4 train.py --deepspeed ds_config.json'
        >>> launch_command(p, "hf")
        'torchrun --nproc-per-node 4 train.py'
        >>> launch_command(p, "lightning")
        'python train.py'
    """
    setup, n = plan.setup, plan.num_gpus
    nodes, per = nodes_of(n)
    torchrun = f"torchrun --nproc-per-node {per} train.py"
    if nodes > 1:  # on each node; the rendezvous is the first node's address
        torchrun = (
            f"torchrun --nnodes {nodes} --nproc-per-node {per} --rdzv-backend c10d "
            "--rdzv-endpoint $MASTER_ADDR:29500 train.py"
        )
    if kind == "lightning":
        return "python train.py" + (" (on each node, MASTER_ADDR and NODE_RANK set)" * (nodes > 1))
    if kind == "hf":
        distributed = "deepspeed" in hf_training_arguments(plan) or setup.sharding == "fsdp"
        return torchrun if n > 1 or distributed else "python train.py"
    if kind == "deepspeed" or (kind is None and is_deepspeed(setup)):
        ds = config_path if kind == "deepspeed" and config_path else "ds_config.json"
        if nodes > 1:  # the launcher reaches every node listed in the hostfile
            return (
                f"deepspeed --hostfile hostfile --num_nodes {nodes} --num_gpus {per} train.py "
                f"--deepspeed {ds}"
            )
        return f"deepspeed --num_gpus {n} train.py --deepspeed {ds}"
    if kind == "accelerate" or setup.sharding == "fsdp":
        acc = config_path if kind == "accelerate" and config_path else "accelerate.yaml"
        rank = " --machine_rank $NODE_RANK --main_process_ip $MASTER_ADDR" if nodes > 1 else ""
        return f"accelerate launch --config_file {acc}{rank} train.py"
    if n > 1:
        return torchrun
    return "python train.py"


def nodes_of(num_gpus: int) -> tuple[int, int]:
    """Machines and GPUs on each for ``num_gpus``: one node up to ``GPUS_PER_NODE`` (8), as the
    time model counts them.

    Example:
        >>> nodes_of(8), nodes_of(16), nodes_of(12)
        ((1, 8), (2, 8), (2, 6))
    """
    nodes = -(-num_gpus // GPUS_PER_NODE)
    return nodes, num_gpus // nodes if num_gpus % nodes == 0 else GPUS_PER_NODE


def lightning_trainer_kwargs(plan: Plan) -> dict[str, Any]:
    """Keyword arguments for ``lightning.pytorch.Trainer``."""
    setup = plan.setup
    precision = {
        "fp32": "32-true",
        "amp-bf16": "bf16-mixed",
        "amp-fp16": "16-mixed",
        "bf16": "bf16-true",
        "fp16": "16-mixed",
    }[setup.precision]
    if setup.sharding in ("zero1", "zero2", "zero3"):
        stage = _zero_stage(setup)
        if setup.offload != "none" and stage == 1:
            stage = 2  # Lightning registers no stage-1 offload; stage 2 is exact and smaller
        strategy = f"deepspeed_stage_{stage}" + ("_offload" if setup.offload != "none" else "")
    elif setup.sharding == "fsdp":
        strategy = "fsdp"
    else:
        strategy = "ddp" if plan.num_gpus > 1 else "auto"
    nodes, per = nodes_of(plan.num_gpus)
    return {
        "accelerator": "gpu",
        "devices": per,
        **({"num_nodes": nodes} if nodes > 1 else {}),
        "strategy": strategy,
        "precision": precision,
        "accumulate_grad_batches": plan.grad_accum_steps,
    }


def _ordinal(k: int | None) -> str:
    return ordinal(k or 1)


def export_caveats(plan: Plan, kind: str) -> list[str]:
    """What the exported config cannot say that the plan assumed (one line each).

    Example:
        >>> from batchfit.models import resolve_model
        >>> from batchfit.hardware import get_gpu
        >>> from batchfit.plan import make_plan
        >>> p = make_plan(resolve_model("gpt2"), get_gpu("a100-40gb"),
        ...               TrainingSetup(loss="chunked", keep_loss=True), seq_len=1024,
        ...               global_batch=64, engine="analytic")
        >>> export_caveats(p, "hf")[0].startswith("the plan assumes a chunked loss")
        True
    """
    setup = plan.setup
    caveats = []
    if setup.loss == "chunked":
        caveats.append(
            f"the plan assumes a chunked loss ({setup.loss_label}), which the {kind} config "
            "cannot switch on: compute the loss per chunk in your loss function (Trainer's "
            "compute_loss_func, your training_step), or plan with --loss full"
        )
    if kind == "hf" and get_optimizer(setup.optimizer).export.hf_optim is None:
        caveats.append(
            f"transformers has no TrainingArguments optim name for {setup.optimizer}, so the "
            "hf config leaves optim out (the Trainer's default is AdamW): build the optimizer "
            "in your script and pass it as Trainer(optimizer_cls_and_kwargs=(cls, kwargs))"
        )
    torch_layout = setup.sharding == "fsdp" or (
        setup.precision == "bf16" and not is_deepspeed(setup)
    )
    if kind == "deepspeed" and torch_layout:
        what = "FSDP sharding" if setup.sharding == "fsdp" else "pure bf16 (no fp32 master)"
        caveats.append(
            f"the plan counted {what}; DeepSpeed with bf16.enabled keeps 16-bit weights and "
            "gradients with an fp32 master partition and fp32 optimizer states, so this config "
            "does not run what was planned: export accelerate (FSDP) or plan with --sharding "
            "zero1|zero2|zero3"
        )
    every = setup.grad_ckpt_every
    # the layers a partial plan checkpoints (the plan's own note names them)
    chosen = f"every {_ordinal(every)} layer with torch.utils.checkpoint" if every else ""
    # HF's TrainingArguments hold both switches and accelerate's FSDP config the
    # checkpointing one; a DeepSpeed JSON, accelerate's other configs and Lightning's Trainer
    # hold neither: the script must switch them on
    has_switch = kind == "hf" or (kind == "accelerate" and setup.sharding == "fsdp")
    if not has_switch:
        needs = []
        if setup.grad_ckpt:
            needs.append(
                f"checkpointing of {chosen}"
                if every
                else "gradient checkpointing (model.gradient_checkpointing_enable())"
            )
        if setup.loss == "fused":
            needs.append("Liger's fused linear cross-entropy (liger_kernel)")
        if needs:
            where = {"deepspeed": "a DeepSpeed config", "lightning": "Lightning's Trainer"}.get(
                kind, "this accelerate config"
            )
            script = "your LightningModule" if kind == "lightning" else "your train.py"
            caveats.append(
                f"the plan needs {' and '.join(needs)}, which {where} cannot switch on: "
                f"{script} must, or the step will not fit"
            )
    elif every:  # the export's switch wraps every layer: no export names layers
        switch = "activation_checkpointing" if kind == "hf" else "fsdp_activation_checkpointing"
        caveats.append(
            f"this export's {switch} wraps every layer (fits, recomputes more than planned): "
            f"for the plan's speed, turn it off and wrap {chosen} in your script"
        )
    if kind == "accelerate" and is_deepspeed(setup):
        caveats.append(
            "accelerate's DeepSpeed plugin fills bucket sizes of its own ('auto'), while the plan "
            "counted DeepSpeed's (reduce_bucket_size 5e8, stage3 buckets): export deepspeed too "
            "and set deepspeed_config_file to it, so the run is the one planned"
        )
    return caveats


def export(plan: Plan, kind: str) -> dict[str, Any]:
    """The export of ``kind`` as a JSON-able dict (accelerate's is written as YAML).

    Example:
        >>> from batchfit.models import resolve_model
        >>> from batchfit.hardware import get_gpu
        >>> from batchfit.plan import make_plan
        >>> p = make_plan(resolve_model("gpt2"), get_gpu("a100-40gb"), TrainingSetup(),
        ...               seq_len=1024, global_batch=64, micro_batch_size=16, engine="analytic")
        >>> export(p, "deepspeed")["gradient_accumulation_steps"]
        4
    """
    extra = _peft_settings(plan)
    if kind == "hf":
        return {"training_arguments": hf_training_arguments(plan), **extra}
    if kind == "deepspeed":
        return deepspeed_config(plan)
    if kind == "accelerate":
        return accelerate_config(plan)
    if kind == "lightning":
        notes = []
        if plan.setup.sharding == "zero3" and plan.setup.offload == "optimizer":
            notes.append(
                "Lightning's deepspeed_stage_3_offload also offloads parameters (slower, less "
                "GPU memory); for optimizer-only offload use "
                "DeepSpeedStrategy(stage=3, offload_optimizer=True)"
            )
        if plan.setup.sharding == "zero1" and plan.setup.offload != "none":
            notes.append(
                "Lightning has no ZeRO-1 offload strategy: stage 2 with offload is "
                "used (exact, and it also shards gradients)"
            )
        return {
            "trainer": lightning_trainer_kwargs(plan),
            "dataloader": {"batch_size": plan.micro_batch_size},
            **extra,
            **({"notes": notes} if notes else {}),
        }
    raise ValueError(f"unknown export kind {kind!r}")


def render(data: dict[str, Any], kind: str) -> str:
    """Text of an export file: YAML for accelerate, JSON otherwise."""
    if kind == "accelerate":
        # lazy: pyyaml is optional, needed only for accelerate's config
        import yaml

        return str(yaml.safe_dump(data, sort_keys=False))
    return json.dumps(data, indent=2) + "\n"


def write_export(plan: Plan, kind: str, out: Path) -> dict[str, str]:
    """Write the export of ``kind`` to ``out``, the one file it needs; ``{kind: path}`` written.

    Atomic: the text goes to a temporary file beside ``out``, then replaces it in one rename, so
    an interrupted or failed write leaves ``out`` as it was. A symlink is written through. What
    is not a regular file (``/dev/stdout``, ``/dev/null``, a FIFO) is written into as it is: a
    rename would replace the device or pipe itself with a file. An ``OSError`` becomes a
    ``UsageError`` naming ``out``.
    """
    text = render(export(plan, kind), kind)
    path = Path(os.path.realpath(out))
    try:
        if path.exists() and not path.is_file():
            with open(path, "w", encoding="utf-8") as f:
                f.write(text)
        else:
            _write_atomically(path, text)
    except OSError as e:
        raise UsageError(f"cannot write the export to {out} (--out): {e.strerror or e}") from None
    return {kind: str(out)}


def _write_atomically(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.{secrets.token_hex(6)}.tmp")
    # 0o666 less the umask, as open(path, "w") gives; an existing file keeps its own mode
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        if path.is_file():
            os.chmod(tmp, path.stat().st_mode & 0o7777)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)  # never leave the half-written temporary behind
        raise
