"""``batchfit probe MODEL --device D``: the fastest micro-batch in a few real training steps.
This module parses and checks the options; ``search/probe.py`` runs the trials,
``render.probe`` prints them."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Annotated

import typer

from batchfit import models
from batchfit._units import parse_size
from batchfit.cli._workload import ImageSizeO, sample_size
from batchfit.cli.common import _check_output, _emit_json
from batchfit.cli.options import JsonO, ModelArg, SeqLenOpt, setup_options
from batchfit.errors import UsageError
from batchfit.memory.estimate import check_workload
from batchfit.plan import probe_identity
from batchfit.spec import TrainingSetup, check_choice
from batchfit.views import plots as _plots

DeviceArg = Annotated[
    str,
    typer.Option("--device", help="cpu|cuda: where the real steps run.", show_default=False),
]
MemoryBudgetO = Annotated[
    str | None,
    typer.Option(
        "--memory-budget",
        help="Memory the training state may take, e.g. 6GiB (required on "
        "the CPU: it becomes an OS limit for the trials).",
    ),
]
ChooseO = Annotated[
    str,
    typer.Option(help="throughput (fastest; within 2% the smaller) | max (largest that fits)"),
]
MaxMicroBatchO = Annotated[
    int | None, typer.Option("--max-micro-batch", help="Largest size to consider.")
]
StepsPerTrialO = Annotated[
    int,
    typer.Option(
        "--steps-per-trial",
        help="Real steps for each size that is timed or chosen (the first is not timed, so "
        "at least 2); a size only measured runs one.",
    ),
]
DatasetSizeO = Annotated[
    int | None,
    typer.Option("--dataset-size", help="Samples per epoch: adds time per epoch to the table."),
]
GlobalBatchO = Annotated[
    int | None,
    typer.Option("--global-batch", help="Also plan accumulation for this global batch (samples)."),
]
PlotO = Annotated[
    Path | None,
    typer.Option("--plot", help="PNG of throughput and peak memory against the micro-batch."),
]
NprocO = Annotated[
    int,
    typer.Option(
        "--nproc",
        help="Ranks to run under torchrun (gloo on the CPU, NCCL on CUDA), sharded as "
        "--sharding ddp|fsdp says; every rank runs the same trials and they agree. "
        "Communication is not run in trials (samples/s leaves it out).",
    ),
]


@setup_options(sharding=True)
def probe(
    model: ModelArg,
    device: DeviceArg,
    setup: TrainingSetup,
    seq_len: SeqLenOpt = None,
    image_size: ImageSizeO = None,
    memory_budget: MemoryBudgetO = None,
    choose: ChooseO = "throughput",
    max_micro_batch: MaxMicroBatchO = None,
    steps_per_trial: StepsPerTrialO = 3,
    dataset_size: DatasetSizeO = None,
    global_batch: GlobalBatchO = None,
    plot: PlotO = None,
    nproc: NprocO = 1,
    as_json: JsonO = False,
) -> None:
    """Find the fastest micro-batch on the real device, in a few real training steps."""
    # the trials (torch) and rich's tables load when the probe runs, not for `batchfit --help`
    from batchfit.cli.render import probe as show
    from batchfit.search import probe as _probe

    check_choice("--device", device, ("cpu", "cuda"))
    check_choice("--choose", choose, ("throughput", "max"))
    _check_probe_numbers(steps_per_trial, max_micro_batch, dataset_size, global_batch)
    if plot is not None:
        _check_output(plot, "--plot")
        _plots.require()  # before the trials, not after them
    budget = parse_size(memory_budget, what="--memory-budget") if memory_budget else None
    # the model first: a misspelt name is the first thing to say
    info = models.resolve_model(model, setup.task)  # on its module: a test may stand in for it
    _check_device(device, budget, max_micro_batch)
    setup = _ranks_setup(setup, nproc, device)
    if seq_len is None and info.task != "image-classification":
        raise UsageError("batchfit probe MODEL needs --seq-len (tokens per sample)")
    seq_len, _ = sample_size(info, seq_len=seq_len, image_size=image_size)
    check_workload(info, 1, seq_len)
    _probe.check_budget(info, setup, seq_len, device, budget)
    spec = _probe.make_spec(
        model, setup, device, seq_len, budget, choose, max_micro_batch, steps_per_trial, nproc
    )
    with show.trial_progress(quiet=as_json) as on_trial:
        result = _probe.run(spec, on_trial)
    report = _probe.report(result, global_batch=global_batch, dataset_size=dataset_size)
    if plot is not None:
        show.probe_plot(result, plot, budget)
    if as_json:
        size = (
            {"seq_len": None, "image_size": seq_len}
            if info.task == "image-classification"
            else {"seq_len": seq_len}
        )
        ident = probe_identity(device, setup)  # what a plan's --throughput-from checks
        _emit_json({"model": info.name, "device": device, **size, **ident, **report.to_json()})
    else:
        show.probe_table(info, report, seq_len, budget, plot)


def _ranks_setup(setup: TrainingSetup, nproc: int, device: str) -> TrainingSetup:
    """The probe's setup for ``--nproc`` ranks: one rank per GPU, DDP unless FSDP is asked."""
    if nproc < 1:
        raise UsageError(f"--nproc must be a positive integer, got {nproc}")
    if nproc == 1:
        if setup.sharding not in ("none", "ddp") or setup.num_gpus > 1:
            raise UsageError(
                "probe: sharding and several GPUs need ranks to run: add --nproc N "
                "(e.g. --nproc 2 --sharding fsdp)"
            )
        return setup
    # the ranks' launcher and torch load for --nproc above 1 only
    import torch

    from batchfit.search.probe import SHARDINGS

    if setup.sharding not in SHARDINGS:
        raise UsageError(
            f"probe --nproc runs torch.distributed (--sharding ddp or fsdp), not "
            f"{setup.sharding}: DeepSpeed ranks are launched by DeepSpeed's own launcher"
        )
    if setup.num_gpus not in (1, nproc):
        raise UsageError(f"--num-gpus {setup.num_gpus} disagrees with --nproc {nproc}")
    if device == "cuda":
        visible = torch.cuda.device_count()
        if nproc > visible:
            raise UsageError(f"--nproc {nproc}: only {visible} CUDA device(s) are visible")
    sharding = "ddp" if setup.sharding == "none" else setup.sharding
    return replace(setup, num_gpus=nproc, sharding=sharding)


def _check_probe_numbers(
    steps_per_trial: int,
    max_micro_batch: int | None,
    dataset_size: int | None,
    global_batch: int | None,
) -> None:
    if steps_per_trial < 2:
        raise UsageError("--steps-per-trial must be at least 2 (the first step is not timed)")
    for name, value in (
        ("--max-micro-batch", max_micro_batch),
        ("--dataset-size", dataset_size),
        ("--global-batch", global_batch),
    ):
        if value is not None and value < 1:
            raise UsageError(f"{name} must be a positive integer, got {value}")


def _check_device(device: str, budget: int | None, max_micro_batch: int | None) -> None:
    if device == "cpu" and budget is None and max_micro_batch is None:
        raise UsageError(
            "on the CPU give --memory-budget (the trials run under an OS limit) "
            "or --max-micro-batch"
        )
    if device == "cuda":
        import torch  # torch loads for the CUDA check only, not for `batchfit --help`

        if not torch.cuda.is_available():
            raise UsageError(
                "--device cuda: no CUDA device is visible here (use --device cpu "
                "with --memory-budget, or `batchfit estimate --gpu NAME`)"
            )
