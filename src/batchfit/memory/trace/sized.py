"""A dry run at a new micro-batch size, from dry runs of the same setup at two other sizes.

Within one setup a dry run makes the same allocations and frees in the same order at every
micro-batch size, and each allocation's bytes are affine in the size: weights, gradients and
optimizer state are fixed, activations and their transients grow by a fixed number of bytes per
sample. Where the histories at two sizes line up event for event (same storages, same order,
the same layer running, every size on an integer line), the history at any other size is that
line, event by event, and so are the moments' components and the module table; the caching
allocator's replay (``estimate``) runs on the interpolated history as on a traced one.

Where the histories do not line up (a loss cut into chunks whose count follows the size, code
that branches on the batch), or a third traced size is off the line, nothing is interpolated
and the size is traced. Torch-free: it only reads what dry runs recorded.
"""

from __future__ import annotations

from collections import OrderedDict
from contextvars import ContextVar
from dataclasses import replace

from batchfit.memory.device.totals import CUBLAS_HANDLES
from batchfit.memory.formulas.loss import KEPT_FAKE_CHUNKS, fused_loss_rows
from batchfit.memory.trace.result import LayerLog, MomentLog, TraceResult, moments_of
from batchfit.models import ModelInfo
from batchfit.spec import TrainingSetup

# Whether a dry run at a new size may come from the histories of earlier ones in this process.
# Off by default: ``estimate`` and the plan's confirmations trace every size they show; the
# per-GPU table (``plan._fit_table``) turns it on for the rows it sizes.
enabled: ContextVar[bool] = ContextVar("interpolate_sizes", default=False)

# The dry runs of this process (with their histories, each run of frees in the order
# ``_canonical`` gives), per setup (``traced_result``'s cache key without the micro-batch and
# the cuBLAS workspace): {(micro-batch, workspace): the runs, shallow and deep or the one whole}
_RUNS: OrderedDict[str, dict[tuple[int, int], tuple[TraceResult, ...]]] = OrderedDict()
# (setup, workspace) whose traced sizes above 1 are not on one line: not interpolated
_OFF_LINE: set[tuple[str, int]] = set()
# setups kept above that differ only in their optimizer: {the setup without it: their keys}
_FAMILIES: dict[str, list[str]] = {}
_KEPT_SETUPS = 32  # the histories of this many setups are kept, the least recently used go
_KEPT_SIZES = 8  # and of this many sizes (with workspaces) of each


def line_of(model: ModelInfo, setup: TrainingSetup, seq: int, micro: int) -> str | None:
    """Which sizes' dry runs of ``setup`` at ``seq`` tokens lie on one line with the dry run
    at ``micro`` (each allocation's bytes affine in the size, so that a size between traced
    ones may be read from them): "" for every size, a name shared by those sizes only, None
    for none (traced at each size).

    The model's own loss (a classifier's always) is affine in the size; so is torchtune's
    chunked loss where its chunks are cut along the sequence (a loop that keeps every chunk's
    logits) or where a fixed count of chunks divides every size's tokens (the count divides a
    decoder-only or encoder model's sequence). Liger's fused loss cuts the tokens into chunks
    of a power of two of rows that grows with the batch: sizes whose tokens make chunks of one
    row count, every chunk full, and more than the dry run keeps of them (the middle ones are
    skipped) make the same allocations, those of a chunk the same at each. Chunks of a fixed
    token count change in number with the batch: traced at each size.

    Example (Llama-3's 128,256-token vocabulary over 4,096 features, 4,096 tokens a sample):
        >>> from batchfit.models import resolve_model
        >>> llama = resolve_model("llama-3.1-8b")
        >>> [line_of(llama, TrainingSetup(loss="fused"), 4096, m) for m in (4, 5, 8, 9)]
        ['chunks of 512 rows', 'chunks of 1024 rows', 'chunks of 1024 rows', 'chunks of 2048 rows']
    """
    if setup.loss == "full" or model.task == "classification":
        return ""
    if model.arch.family in ("encoder-decoder", "vision"):
        return None
    if setup.loss == "chunked":
        if setup.loop == "keep-outputs":
            return ""
        even = setup.loss_chunk_tokens is None and seq % setup.loss_chunks == 0
        return "" if even else None
    arch = model.arch
    # the head reads the hidden states (not a projection of them, as OPT's)
    width = model.config.get("word_embed_proj_dim", arch.hidden_size)
    if setup.loss != "fused" or width != arch.hidden_size:
        return None
    rows = micro * seq
    chunk = fused_loss_rows(rows, arch.vocab_size, arch.hidden_size)
    if rows % chunk or rows // chunk <= 2 * KEPT_FAKE_CHUNKS:
        return None
    return f"chunks of {chunk} rows"


def remember(
    setup_key: str,
    micro: int,
    workspace: int,
    runs: tuple[TraceResult, ...],
    family: str | None = None,
) -> None:
    """Keep ``runs`` (fresh dry runs at ``micro`` with ``workspace`` bytes of cuBLAS
    workspace, with their histories) for interpolation; the timeline's bookkeeping is
    dropped. A third size above 1 is checked against the line through the two kept before
    (``runs_at`` then reads every size from that line, or none). ``family``: the setup's key
    without its optimizer, under which ``siblings`` finds it."""
    if any(r.moments is None for r in runs):
        return  # nothing recorded to interpolate
    if family is not None and setup_key not in _FAMILIES.setdefault(family, []):
        _FAMILIES[family].append(setup_key)
    kept = tuple(_canonical(r) for r in runs)
    sizes = _RUNS.setdefault(setup_key, {})
    if micro > 1:
        same = {m: r for (m, w), r in sizes.items() if w == workspace and m > 1}
        if len(same) >= 2:
            low, high = sorted(same)[:2]
            on_line = _runs_between(same[low], same[high], low, high, micro)
            if on_line is None or not all(
                a.events == b.events and a.phases == b.phases
                for a, b in zip(on_line, kept, strict=True)
            ):
                _OFF_LINE.add((setup_key, workspace))
    sizes[micro, workspace] = kept
    if len(sizes) > _KEPT_SIZES:  # the first ones kept (the bases), the oldest after them go
        del sizes[list(sizes)[_KEPT_SIZES // 2]]
    _RUNS.move_to_end(setup_key)
    while len(_RUNS) > _KEPT_SETUPS:
        gone, _ = _RUNS.popitem(last=False)
        for keys in _FAMILIES.values():
            if gone in keys:
                keys.remove(gone)


def from_histories(result: TraceResult) -> bool:
    """Whether ``result`` was read from histories, not traced (no dry run took any time)."""
    return result.seconds == 0.0


def forget() -> None:
    """Drop every kept history."""
    _RUNS.clear()
    _OFF_LINE.clear()
    _FAMILIES.clear()


def siblings(family: str, setup_key: str) -> list[str]:
    """The kept setups of ``family`` (``remember``) other than ``setup_key``."""
    return [key for key in _FAMILIES.get(family, []) if key != setup_key]


def runs_at(
    setup_key: str, micro: int, workspace: int = 0, between_sizes: bool = True
) -> tuple[TraceResult, ...] | None:
    """The dry runs of ``setup_key`` at ``micro`` with ``workspace`` bytes of cuBLAS
    workspace, from the runs traced in this process: at that size with another workspace (its
    allocations resized), or interpolated between the two smallest sizes above 1 with either
    workspace. None where nothing answers: fewer than two sizes traced, histories that do not
    line up, a traced size off their line. ``between_sizes=False``: only a size traced with
    another workspace answers (a loss whose chunks follow the size)."""
    traced = _RUNS.get(setup_key, {})
    if (micro, workspace) in traced:
        return None  # traced: its own record answers
    by_workspace: dict[int, dict[int, tuple[TraceResult, ...]]] = {}
    for (size, space), kept in traced.items():
        by_workspace.setdefault(space, {})[size] = kept
    for space in sorted(by_workspace, key=lambda w: w != workspace):  # its own first
        runs = by_workspace[space].get(micro)
        if runs is None and between_sizes and (setup_key, space) not in _OFF_LINE:
            runs = _interpolated(by_workspace[space], micro)
        if runs is not None and space != workspace:
            runs = _with_workspace(runs, space, workspace)
        if runs is not None:
            return runs
    return None


def kept(setup_key: str, workspace: int) -> dict[int, tuple[TraceResult, ...]]:
    """The sizes of ``setup_key`` traced in this process with ``workspace``, and their runs."""
    return {m: r for (m, w), r in _RUNS.get(setup_key, {}).items() if w == workspace}


def kept_or_read(
    setup_key: str, micro: int, workspace: int = 0, between_sizes: bool = True
) -> tuple[TraceResult, ...] | None:
    """The dry runs of ``setup_key`` at ``micro``: those traced at that size in this process,
    else ``runs_at``'s."""
    traced = _RUNS.get(setup_key, {}).get((micro, workspace))
    return traced if traced is not None else runs_at(setup_key, micro, workspace, between_sizes)


def _interpolated(
    traced: dict[int, tuple[TraceResult, ...]], micro: int
) -> tuple[TraceResult, ...] | None:
    # at one sample code may take another path (BERT: four fewer allocations, a view where a
    # larger batch copies), so size 1 is neither a base nor interpolated
    bases = sorted(m for m in traced if m > 1)
    if len(bases) < 2 or micro < 2:
        return None
    low, high = bases[:2]
    return _runs_between(traced[low], traced[high], low, high, micro)


def _with_workspace(
    runs: tuple[TraceResult, ...], old: int, new: int
) -> tuple[TraceResult, ...] | None:
    """``runs`` with ``new`` bytes of cuBLAS workspace where they allocated ``old``: the
    workspaces are the run's first allocations labelled other (``CUBLAS_HANDLES`` of them, one
    per handle, made before the first step), and nothing else in a dry run depends on their
    size. None where the history does not show them."""
    out = []
    for run in runs:
        log = run.moments
        if log is None or old <= 0 or new <= 0:
            return None
        # the first allocations labelled other, made as the step begins (after the weights)
        first = [
            (key, delta)
            for key, delta in log.events
            if delta > 0 and log.categories.get(key) == "other"
        ][:CUBLAS_HANDLES]
        keys = {key for key, _ in first}
        if len(keys) != CUBLAS_HANDLES or any(d != old // CUBLAS_HANDLES for _, d in first):
            return None
        history = _resized(log.events, keys, new // CUBLAS_HANDLES)
        events = history
        if log.events is not run.events:
            events = _resized(run.events, keys, new // CUBLAS_HANDLES)
        out.append(read(run.layers, log, events, history))
    return tuple(out)


def read(
    layers: LayerLog | None,
    log: MomentLog,
    events: tuple[tuple[int, int], ...],
    history: tuple[tuple[int, int], ...],
) -> TraceResult:
    """A result read from histories: ``events`` for the allocator, the moments read from
    ``history`` (the same tuple where the dry run read them from its own events)."""
    phases, top = moments_of(history, log)
    moments = replace(log, events=history)
    return TraceResult(
        phases, 0.0, top, events=events, layers=layers, moments=moments, flops=log.flops
    )


def _resized(
    events: tuple[tuple[int, int], ...], keys: set[int], size: int
) -> tuple[tuple[int, int], ...]:
    """``events`` with each storage in ``keys`` allocated (and freed) at ``size`` bytes."""
    return tuple(
        (key, size if delta > 0 else -size) if key in keys else (key, delta)
        for key, delta in events
    )


def _runs_between(
    below: tuple[TraceResult, ...],
    above: tuple[TraceResult, ...],
    low: int,
    high: int,
    micro: int,
) -> tuple[TraceResult, ...] | None:
    if len(below) != len(above):
        return None
    out = []
    for a, b in zip(below, above, strict=True):
        run = interpolate(a, b, low, high, micro)
        if run is None:
            return None
        out.append(run)
    return tuple(out)


def interpolate(
    below: TraceResult, above: TraceResult, low: int, high: int, micro: int
) -> TraceResult | None:
    """The dry run at ``micro`` on the line through ``below`` (traced at ``low``) and
    ``above`` (at ``high``), both kept in ``_canonical`` order: every event's bytes on its
    line, the moments read from the interpolated history; None where the two do not line up."""
    log, other = below.moments, above.moments
    if log is None or other is None or below.layers != above.layers:
        return None
    if (log.marks, log.categories, log.modules) != (other.marks, other.categories, other.modules):
        return None
    events = _line(below.events, above.events, low, high, micro)
    # the moments' own history where the result's is a rebuilt first step and the measured one
    history = events
    if log.events is not below.events:
        history = _line(log.events, other.events, low, high, micro)
    if events is None or history is None:
        return None
    return read(below.layers, log, events, history)


def _line(
    below: tuple[tuple[int, int], ...],
    above: tuple[tuple[int, int], ...],
    low: int,
    high: int,
    micro: int,
) -> tuple[tuple[int, int], ...] | None:
    """The history at ``micro`` on the line through two histories at ``low`` and ``high``:
    the same storages in the same order, each event's bytes an integer on its line and of
    its sign (an allocation stays one); None where they do not line up.

    Example (100 bytes plus 40 per sample, allocated then freed):
        >>> at = lambda m: ((0, 100 + 40 * m), (0, -(100 + 40 * m)))
        >>> _line(at(2), at(5), 2, 5, 9) == at(9)
        True
        >>> _line(at(2), at(5)[:1], 2, 5, 9) is None
        True
    """
    if len(below) != len(above) or not below:
        return None
    out = []
    for (key, a), (other, b) in zip(below, above, strict=True):
        step, remainder = divmod((b - a) * (micro - low), high - low)
        value = a + step
        if key != other or remainder or (value > 0) != (a > 0) or (value < 0) != (a < 0):
            return None
        out.append((key, value))
    return tuple(out)


def _canonical(run: TraceResult) -> TraceResult:
    """``run`` kept for interpolation: no timeline, and each run of consecutive frees sorted
    (``_sorted_frees``), cut where the layer changes and, in the history the moments are read
    from, where the moments change. A history shared by both stays one tuple."""
    log = run.moments
    assert log is not None
    shared = log.events is run.events
    cuts = {mark[0] for mark in log.marks}
    layers = run.layers.event_layers if run.layers is not None else None
    events = tuple(_sorted_frees(run.events, layers, cuts if shared else set()))
    history = events if shared else tuple(_sorted_frees(log.events, None, cuts))
    return replace(run, timeline=None, events=events, moments=replace(log, events=history))


def _sorted_frees(
    events: tuple[tuple[int, int], ...],
    layers: tuple[object, ...] | None,
    cuts: set[int],
) -> list[tuple[int, int]]:
    """``events`` with each run of consecutive frees sorted by storage; a run ends where the
    layer running changes (``layers``) and before an event in ``cuts`` (a change of moment).

    Storages that die together (a graph's saved tensors released at once) are freed in an
    order that follows no size: two sizes' histories differ there only. Neither the caching
    allocator (free blocks merge with their free neighbours, nothing is allocated between)
    nor a moment's peak (read after allocations and where moments change) depends on the
    order of consecutive frees, so the sorted order stands for every order.

    Example:
        >>> _sorted_frees(((5, 8), (3, -4), (1, -2), (2, -1), (4, 6)), None, {3})
        [(5, 8), (1, -2), (3, -4), (2, -1), (4, 6)]
    """
    out = list(events)
    i = 0
    while i < len(out):
        j = i
        while (
            j < len(out)
            and out[j][1] < 0
            and (j == i or j not in cuts)
            and (layers is None or layers[j] == layers[i])
        ):
            j += 1
        out[i:j] = sorted(out[i:j])
        i = max(j, i + 1)
    return out
