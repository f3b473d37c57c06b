"""``batchfit gpus [MODEL]``: the catalog's GPUs; with a model, the largest micro-batch that
fits on each of them."""

from __future__ import annotations

from typing import Annotated

import typer

from batchfit import hardware, models
from batchfit._units import gib, parse_size
from batchfit.cli._workload import ImageSizeO, sample_size
from batchfit.cli.common import _cache_switch, _emit_json
from batchfit.cli.options import (
    EngineO,
    JsonO,
    NoCacheO,
    VerboseO,
    parse_engine,
    setup_options,
)
from batchfit.errors import UsageError
from batchfit.memory.estimate import check_workload, usable_engine
from batchfit.plan import fit_table
from batchfit.spec import TrainingSetup

ModelO = Annotated[
    str | None,
    typer.Argument(help="With a model: the largest micro-batch that fits on each GPU."),
]
SeqLenO = Annotated[
    int | None,
    typer.Option("--seq-len", "-s", help="Tokens per sample (needed with MODEL)."),
]
HeadroomO = Annotated[str, typer.Option("--headroom", help="Free memory to keep.")]


@setup_options()
def gpus(
    setup: TrainingSetup,
    model: ModelO = None,
    seq_len: SeqLenO = None,
    image_size: ImageSizeO = None,
    headroom: HeadroomO = "0.5GiB",
    engine: EngineO = "trace",
    no_cache: NoCacheO = False,
    verbose: VerboseO = False,
    as_json: JsonO = False,
) -> None:
    """List the catalog GPUs; with MODEL --seq-len, what fits on each of them.

    Each row follows one rule (printed under the table): the fastest exact option by the time
    model at its largest micro-batch, with the hours a billion tokens take; CPU offload only
    when over 25% faster; rungs that change training only when nothing exact fits.
    """
    # rich's tables load when a command prints, not for `batchfit --help`
    from batchfit.cli.render import catalog as show

    gpu_list = list(hardware.all_gpus().values())  # on its module: a test may stand in for it
    if model is None:
        if seq_len is not None or image_size is not None:
            raise UsageError("--seq-len needs a MODEL: batchfit gpus MODEL --seq-len S")
        if as_json:
            _emit_json({"gpus": [show.gpu_row(g) for g in gpu_list]})
        else:
            show.gpus(gpu_list)
        return
    headroom_bytes = parse_size(headroom, what="--headroom", allow_zero=True)
    largest = max(gpu_list, key=lambda g: g.memory_bytes)
    if headroom_bytes >= largest.memory_bytes:  # every row would say "none"
        raise UsageError(
            f"--headroom {headroom.strip()} is all of the largest GPU's memory ({largest.name}, "
            f"{gib(largest.memory_bytes)}): keep less free, e.g. 0.5GiB"
        )
    info = models.resolve_model(model, setup.task)  # on its module: a test may stand in for it
    if seq_len is None and info.task != "image-classification":
        raise UsageError("batchfit gpus MODEL needs --seq-len")
    seq_len, _ = sample_size(info, seq_len=seq_len, image_size=image_size)
    check_workload(info, 1, seq_len)
    engine_name = parse_engine(engine)
    with _cache_switch(no_cache, verbose, quiet=as_json):
        rows = fit_table(
            info,
            setup,
            gpu_list,
            seq_len=seq_len,
            headroom_bytes=headroom_bytes,
            engine=engine_name,
        )
    answered, _ = usable_engine(engine_name)
    if as_json:
        _emit_json(show.fit_json(info, seq_len, rows, answered))
    else:
        show.fit_table(info, seq_len, rows, answered)
