"""A shallow dry run unrolled layer by layer is the deep one, allocation for allocation.

The caching allocator's reserve at the model's depth comes from replaying the shallow dry
run's history unrolled to that depth: these tests check the unrolled history against a dry run
of the whole model (the same sizes in the same order, each run of frees in any order) and its
replay (the same reserve), then that the estimate at depth agrees with the whole model's.
"""

import json
from typing import Any

import pytest

from batchfit.hardware import get_gpu
from batchfit.memory.device.allocator import simulate
from batchfit.memory.formulas.analytic import resolve_setup
from batchfit.memory.trace import estimate as trace_estimate
from batchfit.memory.trace.result import LayerLog
from batchfit.memory.trace.unroll import unroll
from batchfit.models import resolve_model
from batchfit.spec import TrainingSetup
from batchfit.workload import Workload
from tests._tiny import TINY_GPT2, TINY_LLAMA_JSON
from tests.memory._cuda_trace import cuda_trace, runs

# two layers past a stack traced at 2 (FSDP's, traced at 4, one past)
DEPTH = 4
LLAMA = {**json.loads(TINY_LLAMA_JSON), "num_hidden_layers": DEPTH}
FSDP_LLAMA = {**LLAMA, "num_hidden_layers": DEPTH + 1}
GPT2 = {**TINY_GPT2, "n_layer": DEPTH}
BERT = {
    "model_type": "bert",
    "architectures": ["BertForSequenceClassification"],
    "hidden_size": 64,
    "num_hidden_layers": DEPTH,
    "num_attention_heads": 4,
    "intermediate_size": 128,
    "vocab_size": 256,
    "max_position_embeddings": 64,
}
T5 = {
    "model_type": "t5",
    "architectures": ["T5ForConditionalGeneration"],
    "d_model": 64,
    "d_kv": 16,
    "d_ff": 128,
    "num_layers": DEPTH,
    "num_heads": 4,
    "vocab_size": 256,
    "decoder_start_token_id": 0,
    "pad_token_id": 0,
    "eos_token_id": 1,
}


def _config(tmp_path: Any, config: dict[str, Any]) -> str:
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    return str(path)


def _traced(path: str, options: dict[str, Any], depth: int | None) -> Any:
    return cuda_trace(path, options, depth=depth, reserve=False)


CASES = [
    (LLAMA, {}, 2),
    (LLAMA, {"method": "lora", "grad_ckpt": True}, 2),
    (LLAMA, {"optimizer": "adamw-8bit", "loss": "chunked"}, 2),
    (FSDP_LLAMA, {"sharding": "fsdp", "num_gpus": 2}, 4),
    (GPT2, {"grad_ckpt": True}, 2),
    (GPT2, {"loop": "keep-outputs"}, 2),
    (BERT, {}, 2),
    (LLAMA, {"optimizer_impl": "for-loop"}, 2),
]


@pytest.mark.parametrize(
    ("config", "options", "traced"),
    CASES,
    ids=["llama", "llama-lora-ckpt", "llama-8bit-chunked", "llama-fsdp2", "gpt2-ckpt",
         "gpt2-keep-outputs", "bert", "llama-for-loop"],
)  # fmt: skip
def test_a_shallow_dry_run_unrolled_allocates_as_the_whole_model(
    tmp_path: Any, config: dict[str, Any], options: dict[str, Any], traced: int
) -> None:
    path = _config(tmp_path, config)
    whole = _traced(path, options, None)
    shallow = _traced(path, options, traced)
    assert shallow.layers is not None
    depth = config.get("num_hidden_layers", config.get("n_layer"))
    full = tuple(depth if d == traced else d for d in shallow.layers.stack_depths)
    events = unroll(shallow.events, shallow.layers, full)
    if options.get("optimizer_impl") == "for-loop" and events is None:
        return  # a loop over parameters may be refused; what is unrolled must be exact
    assert events is not None
    assert runs(events) == runs(whole.events)
    assert simulate(events).reserved_bytes == simulate(whole.events).reserved_bytes


def test_a_stack_whose_bottom_layer_differs_is_not_unrolled(tmp_path: Any) -> None:
    """T5's bottom layer alone computes the relative position bias the others reuse: its
    tensors have no counterparts in the layers above, so the history is not unrolled (the
    caller carries the traced overhead over instead)."""
    shallow = _traced(_config(tmp_path, T5), {"grad_ckpt": True}, 2)
    assert shallow.layers is not None
    full = tuple(DEPTH if d == 2 else d for d in shallow.layers.stack_depths)
    assert unroll(shallow.events, shallow.layers, full) is None


def test_the_estimate_at_depth_reserves_what_the_whole_model_does(tmp_path: Any) -> None:
    """With checkpointing, the overhead the shallow dry runs showed beyond their peaks is not
    the whole model's (carried over, it was 12.6% low on GPT-2 at 8 x 256 on a T4)."""
    model = resolve_model(_config(tmp_path, {**GPT2, "n_layer": 5}))
    gpu = get_gpu("t4")
    setup = resolve_setup(model, TrainingSetup(grad_ckpt=True), "cuda", gpu)
    work = Workload(micro_batch_size=4, seq_len=64, gpu=gpu, grad_accum_steps=2)
    at_depth, whole = (
        trace_estimate.traced_result(model, setup, work, full_depth=full)[0]
        for full in (False, True)
    )
    assert at_depth.reserved_bytes == whole.reserved_bytes


def _log(layers: list[Any], tags: dict[int, tuple[int, int]]) -> LayerLog:
    return LayerLog(tuple(layers), tags, (2,))


def test_each_layer_frees_what_the_one_below_it_left() -> None:
    """Forward up a 2-layer stack: each layer makes a tensor and frees the one below's; the
    head frees the top's. Unrolled to 4 layers, every layer frees its predecessor's."""
    events = [(1, 100), (2, 100), (1, -100), (2, -100)]
    layers = [(0, 0), (0, 1), (0, 1), None]
    unrolled = unroll(events, _log(layers, {1: (0, 0), 2: (0, 1)}), (4,))
    assert unrolled is not None
    assert [delta for _key, delta in unrolled] == [100, 100, -100, 100, -100, 100, -100, -100]
    assert len({key for key, _delta in unrolled}) == 4


def test_a_loop_over_parameters_holding_a_temporary_is_not_unrolled() -> None:
    """An optimizer's loop over parameters p0 (bottom), p1 and p2 (top layer), then the
    head's, each temporary freed once the next is made: copies of the top's, played block by
    block, would all be alive at once."""
    events = [(1, 100), (2, 100), (1, -100), (3, 100), (2, -100), (4, 100), (3, -100), (4, -100)]
    tags = {1: (0, 0), 2: (0, 1), 3: (0, 1)}
    assert unroll(events, _log([None] * 8, tags), (4,)) is None
    # a foreach wave makes all, then frees all: unrolled, every copy's in the one wave
    events = [(1, 100), (2, 100), (2, -100), (1, -100)]
    unrolled = unroll(events, _log([None] * 4, {1: (0, 0), 2: (0, 1)}), (4,))
    assert unrolled is not None
    assert [delta for _key, delta in unrolled] == [100] * 4 + [-100] * 4


def test_a_trace_off_the_per_layer_pattern_is_not_unrolled() -> None:
    # the top's tensor is twice the bottom's: the layers are not copies of each other
    events = [(1, 100), (2, 200), (1, -100), (2, -200)]
    layers = [(0, 0), (0, 1), (0, 1), None]
    assert unroll(events, _log(layers, {1: (0, 0), 2: (0, 1)}), (4,)) is None
    # a stack traced at one layer has no top apart from its bottom
    assert unroll([(1, 100), (1, -100)], LayerLog(((0, 0), None), {1: (0, 0)}, (1,)), (4,)) is None
