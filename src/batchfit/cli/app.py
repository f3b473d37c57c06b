"""Commands: estimate, plan, models, gpus. Compute lives in the library; this file parses."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

import typer

from batchfit._units import human_bytes, parse_size
from batchfit.errors import UsageError
from batchfit.spec import (
    ATTENTIONS,
    METHODS,
    OFFLOADS,
    OPTIMIZER_IMPLS,
    OPTIMIZERS,
    PRECISIONS,
    SHARDINGS,
    TASKS,
    TrainingSetup,
)

app = typer.Typer(
    name="batchfit",
    help="What a training step needs, the micro-batch that fits, and exact accumulation plans.",
    add_completion=False,
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    rich_markup_mode=None,
    context_settings={"help_option_names": ["-h", "--help"]},
)


def _choices(values: tuple[str, ...]) -> str:
    return "|".join(values)


# Options shared by the commands, declared once.
ModelArg = Annotated[
    str,
    typer.Argument(
        help="Catalog name (gpt2, llama-3.1-8b, ...), hub id, path to a config.json or its folder, "
        "or a bare size such as 7B.",
        show_default=False,
    ),
]
SeqLen = Annotated[
    int, typer.Option("--seq-len", "-s", help="Tokens per sample.", show_default=False)
]
Task = Annotated[
    str | None,
    typer.Option(help=f"{_choices(TASKS)}; default from the config's architectures."),
]
Precision = Annotated[
    str,
    typer.Option(
        help=f"auto|{_choices(PRECISIONS[1:])}; auto = "
        "amp-bf16 on a bf16 GPU, amp-fp16 on older, fp32 on CPU."
    ),
]
OptimizerO = Annotated[str, typer.Option("--optimizer", help=_choices(OPTIMIZERS))]
OptimizerImplO = Annotated[
    str,
    typer.Option(
        "--optimizer-impl", help=f"{_choices(OPTIMIZER_IMPLS)}; auto = what PyTorch picks."
    ),
]
MethodO = Annotated[str, typer.Option("--method", help=_choices(METHODS))]
LoraRank = Annotated[int, typer.Option("--lora-rank", help="LoRA rank r.")]
LoraAlpha = Annotated[float, typer.Option("--lora-alpha", help="LoRA alpha (peft default 8).")]
LoraDropout = Annotated[float, typer.Option("--lora-dropout", help="LoRA dropout.")]
LoraTargets = Annotated[
    str | None,
    typer.Option(
        "--lora-targets", help="Comma-separated module names; default: peft's for the model type."
    ),
]
GradCkpt = Annotated[
    bool, typer.Option("--grad-ckpt/--no-grad-ckpt", help="Gradient checkpointing.")
]
AttentionO = Annotated[str, typer.Option("--attention", help=_choices(ATTENTIONS))]
NumGpus = Annotated[int, typer.Option("--num-gpus", help="GPUs (data parallel).")]
ShardingO = Annotated[str, typer.Option("--sharding", help=_choices(SHARDINGS))]
OffloadO = Annotated[str, typer.Option("--offload", help=_choices(OFFLOADS))]
JsonO = Annotated[bool, typer.Option("--json", help="Print one JSON object, nothing else.")]
GpuO = Annotated[
    str | None,
    typer.Option("--gpu", help="Catalog GPU (`batchfit gpus`): implies --device cuda."),
]


def _setup(
    task: str | None,
    precision: str,
    optimizer: str,
    optimizer_impl: str,
    method: str,
    lora_rank: int,
    lora_alpha: float,
    lora_dropout: float,
    lora_targets: str | None,
    grad_ckpt: bool,
    attention: str,
    num_gpus: int,
    sharding: str,
    offload: str,
) -> TrainingSetup:
    targets = None
    if lora_targets is not None:
        targets = tuple(t.strip() for t in lora_targets.split(",") if t.strip())
    if method == "full" and (
        targets is not None or (lora_rank, lora_alpha, lora_dropout) != (8, 8.0, 0.0)
    ):
        raise UsageError(
            "--lora-rank/--lora-alpha/--lora-dropout/--lora-targets need --method lora or qlora"
        )
    return TrainingSetup(
        task=task,  # type: ignore[arg-type]
        precision=precision,  # type: ignore[arg-type]
        optimizer=optimizer,  # type: ignore[arg-type]
        optimizer_impl=optimizer_impl,  # type: ignore[arg-type]
        method=method,  # type: ignore[arg-type]
        lora_rank=lora_rank,
        lora_alpha=lora_alpha,
        lora_dropout=lora_dropout,
        lora_targets=targets,
        grad_ckpt=grad_ckpt,
        attention=attention,  # type: ignore[arg-type]
        num_gpus=num_gpus,
        sharding=sharding,  # type: ignore[arg-type]
        offload=offload,  # type: ignore[arg-type]
    )


def _emit_json(obj: dict[str, Any]) -> None:
    import json

    from batchfit._version import versions

    print(json.dumps({**obj, "versions": versions()}, indent=2))


@app.command()
def estimate(
    model: ModelArg,
    micro_batch: Annotated[
        int,
        typer.Option(
            "--micro-batch", "-b", help="Samples per GPU per forward/backward.", show_default=False
        ),
    ],
    seq_len: SeqLen,
    task: Task = None,
    precision: Precision = "auto",
    optimizer: OptimizerO = "adamw",
    optimizer_impl: OptimizerImplO = "auto",
    method: MethodO = "full",
    lora_rank: LoraRank = 8,
    lora_alpha: LoraAlpha = 8.0,
    lora_dropout: LoraDropout = 0.0,
    lora_targets: LoraTargets = None,
    grad_ckpt: GradCkpt = False,
    attention: AttentionO = "auto",
    device: Annotated[
        str | None,
        typer.Option("--device", help="cpu|cuda (default cuda; --gpu implies cuda)."),
    ] = None,
    gpu: GpuO = None,
    num_gpus: NumGpus = 1,
    sharding: ShardingO = "none",
    offload: OffloadO = "none",
    grad_accum: Annotated[
        int,
        typer.Option(
            "--grad-accum", help="Accumulation steps: above 1, gradients live through forward."
        ),
    ] = 1,
    engine: Annotated[
        str,
        typer.Option(
            help="trace (a dry run of the real step on fake tensors) | analytic "
            "(formulas, no torch import)"
        ),
    ] = "trace",
    explain: Annotated[
        bool,
        typer.Option(
            "--explain", help="Show the modules holding the most activation memory (trace)."
        ),
    ] = False,
    as_json: JsonO = False,
) -> None:
    """Estimate one training step's memory per GPU: weights, gradients, optimizer, activations."""
    from batchfit.cli import render
    from batchfit.hardware import get_gpu
    from batchfit.memory.estimate import estimate as run_estimate
    from batchfit.models import resolve_model

    setup = _setup(
        task,
        precision,
        optimizer,
        optimizer_impl,
        method,
        lora_rank,
        lora_alpha,
        lora_dropout,
        lora_targets,
        grad_ckpt,
        attention,
        num_gpus,
        sharding,
        offload,
    )
    if device not in (None, "cpu", "cuda"):
        raise UsageError(f"--device {device!r} is not one of: cpu, cuda")
    if gpu is not None and device == "cpu":
        raise UsageError("--gpu and --device cpu contradict each other: drop one")
    if engine not in ("analytic", "trace"):
        raise UsageError(f"--engine {engine!r} is not one of: analytic, trace")
    if grad_accum < 1:
        raise UsageError(f"--grad-accum must be a positive integer, got {grad_accum}")
    gpu_spec = get_gpu(gpu) if gpu else None
    info = resolve_model(model, setup.task)
    result = run_estimate(
        info,
        setup,
        micro_batch_size=micro_batch,
        seq_len=seq_len,
        device="cpu" if device == "cpu" else "cuda",
        gpu=gpu_spec,
        engine=engine,  # type: ignore[arg-type]
        grad_accum_steps=grad_accum,
    )
    if result.engine == "trace":
        result = _compare_engines(result, info, setup, gpu_spec, grad_accum)
    if as_json:
        data = result.to_json()
        if gpu_spec is not None:
            data["gpu_bytes"] = gpu_spec.memory_bytes
            data["headroom_bytes"] = gpu_spec.memory_bytes - result.device_total_bytes
            data["fits"] = data["headroom_bytes"] >= 0
        _emit_json(data)
    else:
        render.estimate(result, info, gpu_spec, explain=explain)


def _compare_engines(
    traced: Any, info: Any, setup: TrainingSetup, gpu: Any, grad_accum: int
) -> Any:
    """Say so when the formulas and the dry run disagree by more than 15%."""
    from dataclasses import replace

    from batchfit.memory.estimate import estimate as run_estimate

    formulas = run_estimate(
        info,
        setup,
        micro_batch_size=traced.micro_batch_size,
        seq_len=traced.seq_len,
        device="cpu" if traced.device == "cpu" else "cuda",
        gpu=gpu,
        engine="analytic",
        grad_accum_steps=grad_accum,
    )
    gap = formulas.peak_bytes / traced.peak_bytes - 1
    if abs(gap) <= 0.15:
        return traced
    note = (
        f"the analytic engine differs from this trace by {gap:+.0%} "
        f"({formulas.peak_bytes / 2**30:.2f} GiB): the trace runs the real code, trust it"
    )
    return replace(traced, warnings=(*traced.warnings, note))


@app.command()
def plan(
    model: ModelArg,
    gpu: Annotated[
        str, typer.Option("--gpu", help="Catalog GPU (`batchfit gpus`).", show_default=False)
    ],
    seq_len: SeqLen,
    global_batch: Annotated[
        int | None,
        typer.Option("--global-batch", help="Target global batch in samples."),
    ] = None,
    global_batch_tokens: Annotated[
        int | None,
        typer.Option("--global-batch-tokens", help="Target global batch in tokens."),
    ] = None,
    micro_batch: Annotated[
        int | None,
        typer.Option(
            "--micro-batch", "-b", help="Fix the micro-batch instead of the largest that fits."
        ),
    ] = None,
    base_lr: Annotated[
        float | None,
        typer.Option("--base-lr", help="Learning rate tuned at --base-batch."),
    ] = None,
    base_batch: Annotated[
        int | None,
        typer.Option(
            "--base-batch", help="Batch --base-lr was tuned at (same unit as the target)."
        ),
    ] = None,
    headroom: Annotated[
        str, typer.Option("--headroom", help="Free memory to keep on the GPU, e.g. 1GiB.")
    ] = "0.5GiB",
    task: Task = None,
    precision: Precision = "auto",
    optimizer: OptimizerO = "adamw",
    optimizer_impl: OptimizerImplO = "auto",
    method: MethodO = "full",
    lora_rank: LoraRank = 8,
    lora_alpha: LoraAlpha = 8.0,
    lora_dropout: LoraDropout = 0.0,
    lora_targets: LoraTargets = None,
    grad_ckpt: GradCkpt = False,
    attention: AttentionO = "auto",
    num_gpus: NumGpus = 1,
    sharding: ShardingO = "none",
    offload: OffloadO = "none",
    engine: Annotated[
        str,
        typer.Option(
            help="analytic (default: formulas, no torch import) | trace (fits the micro-batch "
            "with dry runs; the alternatives table stays analytic)"
        ),
    ] = "analytic",
    export_kind: Annotated[
        str | None,
        typer.Option("--export", help="hf|deepspeed|accelerate|lightning"),
    ] = None,
    out: Annotated[
        Path | None,
        typer.Option("--out", help="File for --export (default: print it)."),
    ] = None,
    as_json: JsonO = False,
) -> None:
    """Plan micro-batch x accumulation x GPUs that hit a global batch exactly, and what fits."""
    from batchfit.cli import render
    from batchfit.export import EXPORT_KINDS, export
    from batchfit.export import render as render_export
    from batchfit.hardware import get_gpu
    from batchfit.memory.estimate import check_workload
    from batchfit.models import resolve_model
    from batchfit.plan import make_plan

    setup = _setup(
        task,
        precision,
        optimizer,
        optimizer_impl,
        method,
        lora_rank,
        lora_alpha,
        lora_dropout,
        lora_targets,
        grad_ckpt,
        attention,
        num_gpus,
        sharding,
        offload,
    )
    if export_kind is not None and export_kind not in EXPORT_KINDS:
        raise UsageError(f"--export {export_kind!r} is not one of: {', '.join(EXPORT_KINDS)}")
    if out is not None and export_kind is None:
        raise UsageError("--out needs --export KIND")
    if engine not in ("analytic", "trace"):
        raise UsageError(f"--engine {engine!r} is not one of: analytic, trace")
    gpu_spec = get_gpu(gpu)
    info = resolve_model(model, setup.task)
    check_workload(info, micro_batch or 1, seq_len)
    result = make_plan(
        info,
        gpu_spec,
        setup,
        seq_len=seq_len,
        global_batch=global_batch,
        global_batch_tokens=global_batch_tokens,
        micro_batch_size=micro_batch,
        base_lr=base_lr,
        base_batch=base_batch,
        headroom_bytes=parse_size(headroom, what="--headroom"),
        engine=engine,
    )
    exports: dict[str, Any] = {}
    export_text = None
    if export_kind is not None:
        data = export(result, export_kind)
        export_text = render_export(data, export_kind)
        if out is not None:
            try:
                out.write_text(export_text, encoding="utf-8")
                ds_path = data.get("training_arguments", {}).get("deepspeed")
                if isinstance(ds_path, str):
                    # The hf export points at a DeepSpeed config: write it beside the file.
                    ds_file = out.parent / ds_path
                    ds_file.write_text(render_export(export(result, "deepspeed"), "deepspeed"))
                    exports["deepspeed"] = str(ds_file)
            except OSError as e:
                raise UsageError(f"cannot write --out {out}: {e.strerror}") from None
            exports[export_kind] = str(out)
        else:
            exports[export_kind] = data
    if as_json:
        _emit_json({**result.to_json(), "exports": exports})
    else:
        render.plan(result, info)
        if export_kind is not None:
            render.export_note(export_kind, out, export_text)


@app.command()
def models(as_json: JsonO = False) -> None:
    """List the catalog models (config facts ship with batchfit; no download)."""
    from batchfit.cli import render
    from batchfit.models import catalog_names, resolve_model

    infos = [resolve_model(name) for name in catalog_names()]
    if as_json:
        _emit_json({"models": [render.model_row(i) for i in infos]})
    else:
        render.models(infos)


@app.command()
def gpus(
    model: Annotated[
        str | None,
        typer.Argument(help="With a model: the largest micro-batch that fits on each GPU."),
    ] = None,
    seq_len: Annotated[
        int | None,
        typer.Option("--seq-len", "-s", help="Tokens per sample (needed with MODEL)."),
    ] = None,
    task: Task = None,
    precision: Precision = "auto",
    optimizer: OptimizerO = "adamw",
    optimizer_impl: OptimizerImplO = "auto",
    method: MethodO = "full",
    lora_rank: LoraRank = 8,
    lora_alpha: LoraAlpha = 8.0,
    lora_dropout: LoraDropout = 0.0,
    lora_targets: LoraTargets = None,
    grad_ckpt: GradCkpt = False,
    attention: AttentionO = "auto",
    headroom: Annotated[str, typer.Option("--headroom", help="Free memory to keep.")] = "0.5GiB",
    as_json: JsonO = False,
) -> None:
    """List the catalog GPUs; with MODEL --seq-len, what fits on each of them."""
    from batchfit.cli import render
    from batchfit.hardware import all_gpus

    gpu_list = list(all_gpus().values())
    if model is None:
        if seq_len is not None:
            raise UsageError("--seq-len needs a MODEL: batchfit gpus MODEL --seq-len S")
        if as_json:
            _emit_json({"gpus": [render.gpu_row(g) for g in gpu_list]})
        else:
            render.gpus(gpu_list)
        return
    if seq_len is None:
        raise UsageError("batchfit gpus MODEL needs --seq-len")
    from batchfit.memory.estimate import check_workload
    from batchfit.models import resolve_model
    from batchfit.plan import fit_table

    setup = _setup(
        task,
        precision,
        optimizer,
        optimizer_impl,
        method,
        lora_rank,
        lora_alpha,
        lora_dropout,
        lora_targets,
        grad_ckpt,
        attention,
        1,
        "none",
        "none",
    )
    info = resolve_model(model, setup.task)
    check_workload(info, 1, seq_len)
    rows = fit_table(
        info,
        setup,
        gpu_list,
        seq_len=seq_len,
        headroom_bytes=parse_size(headroom, what="--headroom"),
    )
    if as_json:
        _emit_json({"model": info.name, "seq_len": seq_len, "gpus": [r.to_json() for r in rows]})
    else:
        render.fit_table(info, seq_len, rows)


@app.callback(invoke_without_command=True)
def _root(
    version: Annotated[bool, typer.Option("--version", help="Show versions and exit.")] = False,
) -> None:
    if version:
        from batchfit._version import versions

        print(" ".join(f"{k} {v}" for k, v in versions().items()))
        raise typer.Exit(0)


@app.command()
def probe(
    model: ModelArg,
    seq_len: SeqLen,
    device: Annotated[
        str,
        typer.Option("--device", help="cpu|cuda: where the real steps run.", show_default=False),
    ],
    memory_budget: Annotated[
        str | None,
        typer.Option(
            "--memory-budget",
            help="Memory the training state may take, e.g. 6GiB (required on "
            "the CPU: it becomes an OS limit for the trials).",
        ),
    ] = None,
    choose: Annotated[
        str,
        typer.Option(help="throughput (fastest; within 2% the smaller) | max (largest that fits)"),
    ] = "throughput",
    max_micro_batch: Annotated[
        int | None, typer.Option("--max-micro-batch", help="Largest size to consider.")
    ] = None,
    steps_per_trial: Annotated[
        int,
        typer.Option(
            "--steps-per-trial",
            help="Real steps for each size that is timed or chosen (the first is not timed); "
            "a size only measured runs one.",
        ),
    ] = 3,
    dataset_size: Annotated[
        int | None,
        typer.Option("--dataset-size", help="Samples per epoch: adds time per epoch to the table."),
    ] = None,
    global_batch: Annotated[
        int | None,
        typer.Option(
            "--global-batch", help="Also plan accumulation for this global batch (samples)."
        ),
    ] = None,
    plot: Annotated[
        Path | None,
        typer.Option("--plot", help="PNG of throughput and peak memory against the micro-batch."),
    ] = None,
    task: Task = None,
    precision: Precision = "auto",
    optimizer: OptimizerO = "adamw",
    optimizer_impl: OptimizerImplO = "auto",
    method: MethodO = "full",
    lora_rank: LoraRank = 8,
    lora_alpha: LoraAlpha = 8.0,
    lora_dropout: LoraDropout = 0.0,
    lora_targets: LoraTargets = None,
    grad_ckpt: GradCkpt = False,
    attention: AttentionO = "auto",
    as_json: JsonO = False,
) -> None:
    """Find the fastest micro-batch on the real device, in a few real training steps."""
    from batchfit.cli import render
    from batchfit.memory.estimate import check_workload
    from batchfit.models import resolve_model

    setup = _setup(
        task,
        precision,
        optimizer,
        optimizer_impl,
        method,
        lora_rank,
        lora_alpha,
        lora_dropout,
        lora_targets,
        grad_ckpt,
        attention,
        1,
        "none",
        "none",
    )
    if device not in ("cpu", "cuda"):
        raise UsageError(f"--device {device!r} is not one of: cpu, cuda")
    if choose not in ("throughput", "max"):
        raise UsageError(f"--choose {choose!r} is not one of: throughput, max")
    if steps_per_trial < 2:
        raise UsageError("--steps-per-trial must be at least 2 (the first step is not timed)")
    for name, value in (
        ("--max-micro-batch", max_micro_batch),
        ("--dataset-size", dataset_size),
        ("--global-batch", global_batch),
    ):
        if value is not None and value < 1:
            raise UsageError(f"{name} must be a positive integer, got {value}")
    if plot is not None and not plot.parent.resolve().is_dir():
        raise UsageError(f"--plot {plot}: the folder {plot.parent} does not exist")
    budget = parse_size(memory_budget, what="--memory-budget") if memory_budget else None
    if device == "cpu" and budget is None and max_micro_batch is None:
        raise UsageError(
            "on the CPU give --memory-budget (the trials run under an OS limit) "
            "or --max-micro-batch"
        )
    if device == "cuda":
        import torch

        if not torch.cuda.is_available():
            raise UsageError(
                "--device cuda: no CUDA device is visible here (use --device cpu "
                "with --memory-budget, or `batchfit estimate --gpu NAME`)"
            )
    info = resolve_model(model, setup.task)
    check_workload(info, 1, seq_len)
    _check_budget(info, setup, seq_len, device, budget)
    spec = {
        "model": model,
        "task": setup.task,
        "setup": _setup_dict(setup),
        "device": device,
        "seq_len": seq_len,
        "memory_budget": budget,
        "choose": choose,
        "start": None,  # the probe predicts it with the trace engine
        "high": max_micro_batch,
        "steps_per_trial": steps_per_trial,
    }
    final = _run_probe(spec, quiet=as_json)
    result = final["result"]
    if global_batch is not None:
        # only a size that ran: the largest up to the choice that divides the global batch
        ran = {t["micro_batch_size"] for t in result["trials"] if t["ok"]}
        divides = [n for n in ran if n <= result["micro_batch_size"] and global_batch % n == 0]
        if divides:
            result["plan"] = {
                "micro_batch_size": max(divides),
                "grad_accum_steps": global_batch // max(divides),
                "global_batch_size": global_batch,
            }
        else:
            result.setdefault("notes", []).append(
                f"no size that ran divides --global-batch {global_batch}; for a plan: "
                f"`batchfit plan MODEL --global-batch {global_batch} --micro-batch N`"
            )
    if dataset_size is not None:
        result["dataset_size"] = dataset_size
        for t in result["trials"]:
            speed = t["samples_per_s"]
            t["epoch_seconds"] = dataset_size / speed if speed else None
    if plot is not None:
        render.probe_plot(result, plot, budget)
    if as_json:
        _emit_json({"model": info.name, "device": device, "seq_len": seq_len, **result})
    else:
        render.probe_table(info, result, seq_len, budget, dataset_size, plot)


def _setup_dict(setup: TrainingSetup) -> dict[str, Any]:
    from dataclasses import asdict

    return {k: (list(v) if isinstance(v, tuple) else v) for k, v in asdict(setup).items()}


def _check_budget(
    info: Any, setup: TrainingSetup, seq_len: int, device: str, budget: int | None
) -> None:
    """Refuse a budget below what one step at micro-batch 1 needs, with the figure."""
    from batchfit.memory.estimate import estimate as run_estimate

    if budget is None:
        return
    need = run_estimate(
        info,
        setup,
        micro_batch_size=1,
        seq_len=seq_len,
        device="cpu" if device == "cpu" else "cuda",
        engine="analytic",
    ).peak_bytes
    if need > budget:
        raise UsageError(
            f"--memory-budget {human_bytes(budget)} is below the {human_bytes(need)} one step of "
            "micro-batch 1 needs (weights, gradients, optimizer state, activations): "
            "give at least that"
        )


def _run_probe(spec: dict[str, Any], *, quiet: bool) -> dict[str, Any]:
    """Run the search (a budgeted child process on the CPU) with a progress bar on stderr."""
    from batchfit import _probe
    from batchfit.cli import render

    with render.trial_progress(quiet=quiet) as on_trial:
        if spec["device"] == "cpu":
            return _probe.run_child(spec, on_trial)
        final = _probe.probe(spec, on_trial)
    if "usage_error" in final:
        raise UsageError(final["usage_error"])
    return final
