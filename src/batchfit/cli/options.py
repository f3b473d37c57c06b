"""The options shared by the commands, declared once.

``@setup_options()`` adds the setup's typer parameters below to a command's signature and hands
the command one ``setup: TrainingSetup`` in their place; each choice is checked here, at the
boundary, so what reaches the library is typed with the ``Literal``s of ``spec.py``. The
``Annotated`` aliases at the end (MODEL, --seq-len, --json, --engine, ...) are the options
several commands take with the same help.
"""

from __future__ import annotations

import functools
import inspect
import math
import os
from collections.abc import Callable
from dataclasses import replace
from typing import Annotated, Any, Literal, TypeVar, cast, get_args

import typer

from batchfit.errors import UsageError
from batchfit.frameworks import with_framework
from batchfit.optimizers import OPTIMIZERS
from batchfit.presets import FRAMEWORKS
from batchfit.spec import (
    ATTENTIONS,
    FROZEN_DTYPES,
    LOOPS,
    LORA_DTYPES,
    METHODS,
    OFFLOADS,
    OPTIMIZER_IMPLS,
    PRECISIONS,
    SHARDINGS,
    TASKS,
    Attention,
    FrozenDtype,
    Loop,
    LoraDtype,
    Method,
    Offload,
    OptimizerImpl,
    Precision,
    Sharding,
    Task,
    TrainingSetup,
    check_choice,
    parse_loss,
)

F = TypeVar("F", bound=Callable[..., Any])


def finite_float(text: str) -> float:
    """Typer parser for float options: NaN and infinities are refused at parsing."""
    try:
        value = float(text)
    except ValueError:
        raise typer.BadParameter(f"{text!r} is not a number") from None
    if not math.isfinite(value):
        raise typer.BadParameter(f"{text!r} is not a finite number")
    return value


def _choices(values: tuple[str, ...]) -> str:
    """The values an option takes, for its help: spaced, so help wraps between values."""
    return " | ".join(values)


# Options a --framework preset sets: None on the command line means "not given", so the preset
# (or, without one, the default here) applies; a value given wins over the preset.
_PRESET_DEFAULTS = {
    "loop": "trainer",
    "loss": "full",
    "lora_dtype": "fp32",
    "frozen_dtype": "auto",
    "optimizer_impl": "auto",
}


def _parse(raw: dict[str, Any]) -> TrainingSetup:
    explicit = frozenset(k for k in _PRESET_DEFAULTS if raw[k] is not None)
    if raw.get("fsdp_version") is not None:  # given: wins over the --framework's version
        explicit |= {"fsdp_version"}
    raw = {**raw, **{k: v for k, v in _PRESET_DEFAULTS.items() if raw[k] is None}}
    framework = raw["framework"]
    if framework is not None:
        check_choice("--framework", framework, FRAMEWORKS)
    # no --method: pre-training (a full run the planner keeps full)
    keep_method = raw["method"] is None
    raw = {**raw, "method": raw["method"] or "full"}
    setup = replace(_setup(raw), keep_loss="loss" in explicit, keep_method=keep_method)
    if framework is None:
        return setup
    return with_framework(setup, framework, explicit)


def _fsdp_version(text: str | None) -> int | None:
    """``--fsdp-version``: 1 or 2 (None: not given)."""
    if text is None:
        return None
    if text.strip() not in ("1", "2"):
        raise UsageError(f"--fsdp-version must be 1 or 2, got {text!r}")
    return int(text)


def _gpu_number(text: str) -> int:
    """``--num-gpus N``: a whole number (``auto`` is taken by the commands that allow it)."""
    try:
        return int(text)
    except ValueError:
        raise UsageError(f"--num-gpus must be a whole number of GPUs, got {text!r}") from None


def _setup(raw: dict[str, Any]) -> TrainingSetup:
    targets = raw["lora_targets"]
    lora = (targets, raw["lora_rank"], raw["lora_alpha"], raw["lora_dropout"])
    if raw["method"] == "full" and lora != (None, 8, 8.0, 0.0):
        raise UsageError(
            "--lora-rank/--lora-alpha/--lora-dropout/--lora-targets need --method lora or qlora"
        )
    loss, loss_chunks, loss_chunk_tokens = parse_loss(raw["loss"])
    return TrainingSetup(
        task=cast(Task, check_choice("--task", raw["task"], TASKS)) if raw["task"] else None,
        precision=cast(Precision, check_choice("--precision", raw["precision"], PRECISIONS)),
        optimizer=check_choice("--optimizer", raw["optimizer"], OPTIMIZERS),
        optimizer_impl=cast(
            OptimizerImpl, check_choice("--optimizer-impl", raw["optimizer_impl"], OPTIMIZER_IMPLS)
        ),
        method=cast(Method, check_choice("--method", raw["method"], METHODS)),
        lora_rank=raw["lora_rank"],
        lora_alpha=raw["lora_alpha"],
        lora_dropout=raw["lora_dropout"],
        lora_targets=None
        if targets is None
        else tuple(t.strip() for t in targets.split(",") if t.strip()),
        grad_ckpt=raw["grad_ckpt"],
        attention=cast(Attention, check_choice("--attention", raw["attention"], ATTENTIONS)),
        num_gpus=_gpu_number(raw.get("num_gpus", "1")),
        sharding=cast(Sharding, check_choice("--sharding", raw.get("sharding", "none"), SHARDINGS)),
        offload=cast(Offload, check_choice("--offload", raw.get("offload", "none"), OFFLOADS)),
        loop=cast(Loop, check_choice("--loop", raw["loop"], LOOPS)),
        loss=loss,
        loss_chunks=loss_chunks,
        loss_chunk_tokens=loss_chunk_tokens,
        lora_dtype=cast(LoraDtype, check_choice("--lora-dtype", raw["lora_dtype"], LORA_DTYPES)),
        frozen_dtype=cast(
            FrozenDtype, check_choice("--frozen-dtype", raw["frozen_dtype"], FROZEN_DTYPES)
        ),
        expandable_segments=expandable_from_env()
        if raw["expandable_segments"] is None
        else raw["expandable_segments"],
        compile=raw["compile"],
        grad_ckpt_every=raw["grad_ckpt_every"],
        fsdp_version=_fsdp_version(raw.get("fsdp_version")),
    )


def expandable_from_env(conf: str | None = None) -> bool:
    """Whether ``PYTORCH_CUDA_ALLOC_CONF`` (or ``conf``) turns on expandable segments.

    Example:
        >>> expandable_from_env("max_split_size_mb:128,expandable_segments:True")
        True
        >>> expandable_from_env("")
        False
    """
    if conf is None:
        conf = os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "")
    for item in conf.split(","):
        key, _, value = item.partition(":")
        if key.strip() == "expandable_segments":
            return value.strip().lower() in ("true", "1")
    return False


def _option(annotation: Any, default: Any, *names: str, **kwargs: Any) -> tuple[Any, Any]:
    return Annotated[annotation, typer.Option(*names, **kwargs)], default


# name -> (annotation with its typer option, default); the order is the order of --help.
_SHARED: dict[str, tuple[Any, Any]] = {
    "task": _option(
        str | None,
        None,
        "--task",
        help=f"{_choices(TASKS)}; default from the config's architectures.",
    ),
    "precision": _option(
        str,
        "auto",
        "--precision",
        help=f"auto | {_choices(PRECISIONS[1:])}; auto = "
        "amp-bf16 on a bf16 GPU, amp-fp16 on older, fp32 on CPU.",
    ),
    "optimizer": _option(str, "adamw", "--optimizer", help=_choices(OPTIMIZERS)),
    "optimizer_impl": _option(
        str | None,
        None,
        "--optimizer-impl",
        help=f"{_choices(OPTIMIZER_IMPLS)}; auto = what PyTorch picks (the default unless "
        "--framework sets it).",
    ),
    "method": _option(
        str | None,
        None,
        "--method",
        help=f"{_choices(METHODS)}; default full, and `plan` then offers no LoRA/QLoRA "
        "(pre-training).",
    ),
    "lora_rank": _option(int, 8, "--lora-rank", help="LoRA rank r."),
    "lora_alpha": _option(
        float, 8.0, "--lora-alpha", help="LoRA alpha (peft default 8).", parser=finite_float
    ),
    "lora_dropout": _option(
        float, 0.0, "--lora-dropout", help="LoRA dropout.", parser=finite_float
    ),
    "lora_targets": _option(
        str | None,
        None,
        "--lora-targets",
        help="Comma-separated module names, or all-linear (every linear module but the "
        "output head); default: peft's for the model type.",
    ),
    "grad_ckpt": _option(bool, False, "--grad-ckpt/--no-grad-ckpt", help="Gradient checkpointing."),
    "grad_ckpt_every": _option(
        int | None,
        None,
        "--grad-ckpt-every",
        help="Checkpoint every K-th layer (layers K-1, 2K-1, ...; implies --grad-ckpt): a dial "
        "between none and all, each checkpointed layer costs a recompute.",
    ),
    "compile": _option(
        bool, False, "--compile/--no-compile", help="torch.compile: changes the predicted time."
    ),
    "expandable_segments": _option(
        bool | None,
        None,
        "--expandable-segments/--no-expandable-segments",
        help="CUDA allocator with expandable_segments (default: as PYTORCH_CUDA_ALLOC_CONF "
        "in this shell says).",
    ),
    "attention": _option(str, "auto", "--attention", help=_choices(ATTENTIONS)),
    "framework": _option(
        str | None,
        None,
        "--framework",
        help=f"{_choices(FRAMEWORKS)}: that framework's loop, loss, adapter/frozen dtypes, "
        "optimizer (and precision for torchtune/litgpt); options given explicitly win.",
    ),
    "loop": _option(
        str | None,
        None,
        "--loop",
        help=f"{_choices(LOOPS)}; trainer = only the loss outlives forward (HF Trainer, TRL, "
        "Lightning); keep-outputs = a hand loop holding the outputs through backward.",
    ),
    "loss": _option(
        str | None,
        None,
        "--loss",
        help="full|chunked[:N|:Nt]|fused; full = vocabulary-wide logits (HF; default); chunked = "
        "head and loss per N chunks of the tokens (torchtune; N=8) or per chunk of N tokens "
        "(litgpt: 128t); fused = Liger's fused linear cross-entropy (no logits held).",
    ),
    "lora_dtype": _option(
        str | None,
        None,
        "--lora-dtype",
        help=f"{_choices(LORA_DTYPES)}; the LoRA adapters' dtype (peft: fp32; litgpt "
        "bf16-true: bf16).",
    ),
    "frozen_dtype": _option(
        str | None,
        None,
        "--frozen-dtype",
        help=f"{_choices(FROZEN_DTYPES)}; LoRA's frozen base; auto = 16-bit under a 16-bit "
        "precision; fp32 as Lightning bf16-mixed keeps it.",
    ),
}
# Data parallelism: not for `gpus` (one GPU each); `probe` takes --sharding (its --nproc ranks).
_PARALLEL: dict[str, tuple[Any, Any]] = {
    "num_gpus": _option(
        str,
        "1",
        "--num-gpus",
        help="GPUs (data parallel); plan compares DDP, ZeRO-1/2/3 and FSDP2 on them; "
        "plan takes auto: 1, 2, 4, ... up to --max-gpus, and picks the count.",
    ),
    "sharding": _option(
        str,
        "none",
        "--sharding",
        help=f"{_choices(SHARDINGS)}; ddp = torch DDP, zero1|zero2|zero3 = DeepSpeed ZeRO "
        "(16-bit weights and gradients, fp32 master partition in the optimizer), "
        "fsdp = FSDP (--fsdp-version).",
    ),
    "offload": _option(str, "none", "--offload", help=_choices(OFFLOADS)),
    "fsdp_version": _option(
        str | None,
        None,
        "--fsdp-version",
        help="1|2; --sharding fsdp as FullyShardedDataParallel (1: flat parameters, accelerate "
        "and Lightning) or fully_shard (2); default: the --framework's, else 2.",
    ),
}


# Parameters the decorator fills in, not options typer shows.
_GIVEN = frozenset({"setup", "num_gpus_auto"})


def setup_options(
    *, parallel: bool = False, sharding: bool = False, auto_gpus: bool = False
) -> Callable[[F], F]:
    """Decorate a command taking ``setup: TrainingSetup``: typer sees the shared options in
    its place (``parallel`` adds --num-gpus/--sharding/--offload, ``sharding`` --sharding
    alone) and the command gets them parsed into one ``TrainingSetup``. With ``auto_gpus``,
    ``--num-gpus auto`` reaches the command as ``num_gpus_auto=True`` (and 1 in the setup);
    elsewhere it is refused."""
    extra = _PARALLEL if parallel else {"sharding": _PARALLEL["sharding"]} if sharding else {}
    shared = {**_SHARED, **extra}

    def decorate(command: F) -> F:
        signature = inspect.signature(command, eval_str=True)
        own = [p for p in signature.parameters.values() if p.name not in _GIVEN]
        added = [
            inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, annotation=a, default=d)
            for name, (a, d) in shared.items()
        ]
        params = [p.replace(kind=inspect.Parameter.KEYWORD_ONLY) for p in own] + added

        @functools.wraps(command)
        def wrapper(**kwargs: Any) -> Any:
            raw = {name: kwargs.pop(name) for name in shared}
            if str(raw.get("num_gpus", "")).strip().lower() == "auto":
                if not auto_gpus:
                    raise UsageError("--num-gpus auto is for `batchfit plan`: give a number")
                raw["num_gpus"] = "1"
                kwargs["num_gpus_auto"] = True
            return command(setup=_parse(raw), **kwargs)

        wrapper.__dict__["__signature__"] = signature.replace(parameters=params)
        wrapper.__annotations__ = {p.name: p.annotation for p in params}
        del wrapper.__wrapped__  # typer must read the new signature, not the command's
        return cast(F, wrapper)

    return decorate


# --- options several commands declare the same way ---

ModelArg = Annotated[
    str,
    typer.Argument(
        help="Catalog name (gpt2, llama-3.1-8b, ...), hub id, path to a config.json or its folder, "
        "or a bare size such as 7B.",
        show_default=False,
    ),
]
SeqLenOpt = Annotated[
    int | None,
    typer.Option(
        "--seq-len",
        "-s",
        help="Tokens per sample (with --lengths: the truncation, padding or pack length).",
        show_default=False,
    ),
]
LengthsO = Annotated[
    list[str] | None,
    typer.Option(
        "--lengths",
        help="A dataset's sequence lengths: one per line, or a JSON {length: samples}; "
        "FILE:WEIGHT and repeated for a multi-task mixture.",
        show_default=False,
    ),
]
PaddingO = Annotated[
    str | None,
    typer.Option(
        "--padding",
        help="longest (default: each micro-batch padded to its longest sample) | max (to "
        "--seq-len) | packed (rows of --seq-len): with --lengths.",
        show_default=False,
    ),
]
JsonO = Annotated[bool, typer.Option("--json", help="Print one JSON object, nothing else.")]
GpuO = Annotated[
    str | None,
    typer.Option("--gpu", help="Catalog GPU (`batchfit gpus`): implies --device cuda."),
]
Headroom = Annotated[
    str,
    typer.Option(
        "--headroom",
        help="Free memory to keep on the GPU, e.g. 1GiB; auto (plan): the 99th percentile of "
        "`batchfit calibration`'s records.",
    ),
]
EngineO = Annotated[
    str,
    typer.Option(
        "--engine",
        help="trace (default: a dry run of the real step on fake tensors; the analytic engine "
        "answers, and says so, without torch) | analytic (formulas, no torch import)",
    ),
]
NoCacheO = Annotated[
    bool,
    typer.Option(
        "--no-cache",
        help="Trace again instead of reading dry-run results cached on disk (user cache dir).",
    ),
]
LearnedTimeO = Annotated[
    bool,
    typer.Option(
        "--learned-time/--no-learned-time",
        help="Scale the predicted step time by what your runs measured on this GPU (the "
        "training callbacks and probe record it: `batchfit calibration`); the time line "
        "says by how much. --no-learned-time: the time model alone.",
    ),
]
VerboseO = Annotated[
    bool,
    typer.Option(
        "--verbose",
        "-v",
        help="Notes on the trace cache (unreadable or unwritable files it skipped).",
    ),
]

Engine = Literal["analytic", "trace"]
ENGINES: tuple[str, ...] = get_args(Engine)


def parse_engine(value: str) -> Engine:
    """``--engine``, checked against :data:`ENGINES`."""
    return cast(Engine, check_choice("--engine", value, ENGINES))
