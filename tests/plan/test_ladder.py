"""The ladder of memory-saving rungs follows the framework: torchtune has no DeepSpeed rungs,
the LoRA rung keeps a preset's adapter dtype, and a rung the GPU cannot run is one line."""

from __future__ import annotations

from batchfit.frameworks import with_framework
from batchfit.hardware import get_gpu
from batchfit.models import resolve_model
from batchfit.plan._fit_table import fit_table
from batchfit.plan._ladder import LORA, ladder
from batchfit.spec import TrainingSetup
from tests._cli import run_cli


def _rungs(setup: TrainingSetup, gpu: str) -> list[list[str]]:
    return [[t.name for t in c] for c in ladder(setup, get_gpu(gpu), resolve_model("gpt2"))]


def test_torchtune_ladder_has_no_deepspeed_rungs_and_no_redundant_pure_bf16():
    one = _rungs(TrainingSetup(framework="torchtune"), "a100-40gb")
    names = {n for combo in one for n in combo}
    assert not names & {"zero1", "zero2", "zero3", "offload-optimizer", "pure-bf16"}
    several = _rungs(TrainingSetup(framework="torchtune", num_gpus=4), "a100-40gb")
    assert any("fsdp" in combo for combo in several)
    plain = {n for combo in _rungs(TrainingSetup(), "a100-40gb") for n in combo}
    assert {"zero2", "offload-optimizer", "pure-bf16"} <= plain  # HF: unchanged


def test_the_lora_rung_keeps_the_presets_adapter_dtype():
    for framework in ("torchtune", "litgpt"):
        assert LORA(with_framework(TrainingSetup(), framework)).lora_dtype == "bf16"
    assert LORA(TrainingSetup()).lora_dtype == "fp32"


def test_torchtune_qlora_without_bf16_is_one_line_and_one_row(capsys):
    args = ["plan", "llama-3.2-1b", "--gpu", "t4", "--framework", "torchtune"]
    code, _, err = run_cli(
        [*args, "--method", "qlora", "-s", "512", "--global-batch", "16"], capsys
    )
    assert code == 2 and "torchtune's QLoRA needs bf16" in err
    setup = with_framework(TrainingSetup(method="qlora"), "torchtune")
    rows = fit_table(
        resolve_model("gpt2"),
        setup,
        [get_gpu("t4"), get_gpu("a100-40gb")],
        seq_len=256,
        engine="analytic",
    )
    assert rows[0].note and not rows[1].note and rows[1].max_micro_batch > 0
