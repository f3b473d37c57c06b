"""The dry-run trace: it allocates what real CPU tensors do, by category and phase, with
checkpointing, LoRA, autocast, kernel emulation and extrapolation over depth."""

import json

import pytest
import torch
import transformers

from batchfit.hardware import get_gpu
from batchfit.memory.device.kernels import FlashAttentionMemory, cuda_kernels
from batchfit.memory.estimate import estimate
from batchfit.memory.trace import dry_run as trace
from batchfit.memory.trace import estimate as _trace_estimate
from batchfit.memory.trace import hf as _hf_trace
from batchfit.models import resolve_model
from batchfit.optimizers import make_optimizer
from batchfit.spec import TrainingSetup
from batchfit.workload import Workload
from tests.memory._dry_vs_real import assert_dry_run_matches_real

pytestmark = pytest.mark.slow

# Four layers: a traced estimate dry-runs 1 and 2 of them and extrapolates to 4, twice as deep
# as its deeper dry run; the full-depth traces it is compared with stay quick.
LAYERS = 4
TINY_GPT2 = {
    "model_type": "gpt2",
    "n_layer": LAYERS,
    "n_embd": 64,
    "n_head": 4,
    "vocab_size": 512,
    "n_positions": 256,
    "architectures": ["GPT2LMHeadModel"],
}
TINY_LLAMA = {
    "model_type": "llama",
    "hidden_size": 64,
    "intermediate_size": 176,
    "num_hidden_layers": LAYERS,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 512,
    "max_position_embeddings": 512,
}
# the steps run on real CPU tensors, whole: two layers (a first and a last) show every kind
REAL_GPT2 = {**TINY_GPT2, "n_layer": 2}
REAL_LLAMA = {**TINY_LLAMA, "num_hidden_layers": 2}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """Each config at one path for the whole file: a dry run is cached under the model's path,
    so an estimate that several tests ask for (GPT-2 in fp32 at 4 x 256 on the CPU) is traced
    once."""
    root = tmp_path_factory.mktemp("trace")
    models = {}

    def write(cfg):
        key = json.dumps(cfg, sort_keys=True)
        if key not in models:
            path = root / f"{len(models)}" / "config.json"
            path.parent.mkdir()
            path.write_text(json.dumps(cfg))
            models[key] = resolve_model(str(path))
        return models[key]

    return write


def _parts(info, setup, micro=2, seq=32):
    setup = setup.resolved(device="cpu", bf16_supported=True)
    return _hf_trace.step_parts(info, setup, micro=micro, seq=seq, emulate_cuda=False)


def _run(parts):
    return trace.run_steps(
        parts.model,
        parts.optimizer,
        parts.make_batch,
        parts.loss_of,
        autocast_dtype=parts.autocast_dtype,
    )


@pytest.mark.parametrize(
    "setup",
    [
        TrainingSetup(precision="fp32"),
        TrainingSetup(precision="amp-bf16", grad_ckpt=True),
        TrainingSetup(method="lora", precision="fp32"),
    ],
)
def test_dry_run_matches_real_cpu_tensors_exactly(tiny, setup):
    # The same step on real CPU tensors and on fake tensors allocates the same storages.
    info = tiny(REAL_LLAMA)
    torch.manual_seed(0)
    real = _run(_parts(info, setup))
    fake = _hf_trace.trace_once(
        info,
        setup.resolved(device="cpu", bf16_supported=True),
        micro=2,
        seq=32,
        device="cpu",
        workspace=0,
        depth=None,
        grad_accum_steps=1,
    )
    fake_by = {p.key: p for p in fake.phases}
    assert set(fake_by) == {p.key for p in real.phases}
    for phase in real.phases:
        if setup.grad_ckpt:
            # Checkpointing stashes a few KB per layer (RNG state) that only the fake run sees.
            assert fake_by[phase.key].total == pytest.approx(phase.total, rel=0.01)
        else:
            assert fake_by[phase.key].components == phase.components


def test_categories(tiny):
    info = tiny(REAL_GPT2)
    result = _run(_parts(info, TrainingSetup(precision="fp32")))
    step = next(p for p in result.phases if p.key == "optimizer-step|s2").components
    params = info.total_params
    buffers = step["weights"] - 4 * params
    assert 0 <= buffers < 0.01 * 4 * params  # weights = parameters (+ tiny buffers)
    tensors = sum(1 for _ in _parts(info, TrainingSetup()).model.parameters())
    # AdamW: exp_avg + exp_avg_sq (fp32) and a 0-dim fp32 step count per parameter tensor
    assert step["optimizer_state"] == 8 * params + 4 * tensors
    assert step["gradients"] == 4 * params


def test_peak_phase_moves_with_batch(tiny):
    info = tiny(TINY_GPT2)
    # On CUDA, foreach AdamW's sqrt(exp_avg_sq) copy of every parameter tops a tiny backward.
    small = estimate(
        info,
        TrainingSetup(precision="fp32"),
        micro_batch_size=1,
        seq_len=8,
        device="cuda",
        gpu=get_gpu("a100-80gb"),
        engine="trace",
    )
    large = estimate(
        info,
        TrainingSetup(precision="fp32"),
        micro_batch_size=4,
        seq_len=256,
        device="cpu",
        engine="trace",
    )
    assert small.peak_phase == "optimizer-step"
    assert large.peak_phase == "backward"
    assert large.components["activations"] > large.components["weights"]


def test_lora_on_every_linear_under_autocast_keeping_outputs(tiny):
    """Adapters on all seven Llama linears, fp32 adapters under bf16 autocast, the outputs
    held through backward: each adapter's cast copies of its input, the autocast cast cache
    of A and B, and the kept bf16 logits, moment by moment as real CPU tensors allocate them."""
    info = tiny(REAL_LLAMA)
    targets = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
    setup = TrainingSetup(
        precision="amp-bf16",
        method="lora",
        lora_rank=16,
        lora_targets=targets,
        loop="keep-outputs",
    )
    assert_dry_run_matches_real(info, setup, micro=4, seq=64)


def test_checkpointing_lora_and_autocast(tiny):
    info = tiny(TINY_LLAMA)
    kw = {"micro_batch_size": 8, "seq_len": 128, "device": "cpu", "engine": "trace"}
    full = estimate(info, TrainingSetup(precision="fp32"), **kw)
    ckpt = estimate(info, TrainingSetup(precision="fp32", grad_ckpt=True), **kw)
    lora = estimate(info, TrainingSetup(precision="fp32", method="lora"), **kw)
    amp = estimate(info, TrainingSetup(precision="amp-bf16"), **kw)
    assert ckpt.activation_peak_bytes < full.activation_peak_bytes
    assert lora.trainable_params == info.lora_params(8)
    adapters = 2 * 2 * LAYERS  # A and B on q_proj and v_proj in each layer: a step tensor each
    assert lora.components["optimizer_state"] == 8 * lora.trainable_params + 4 * adapters
    # autocast: fp32 master weights, 16-bit matmul outputs
    assert amp.components["weights"] == full.components["weights"]
    assert amp.activation_peak_bytes < full.activation_peak_bytes


# the sizes of the other tests' estimates of the same model and setup: their dry runs serve both
@pytest.mark.parametrize(
    ("cfg", "setup", "micro", "seq"),
    [
        (TINY_GPT2, TrainingSetup(precision="fp32"), 4, 256),
        (TINY_GPT2, TrainingSetup(precision="bf16", grad_ckpt=True), 4, 128),
        (TINY_LLAMA, TrainingSetup(precision="fp32"), 8, 128),
        (TINY_LLAMA, TrainingSetup(precision="bf16", grad_ckpt=True), 4, 128),
    ],
    ids=["gpt2", "gpt2-bf16-ckpt", "llama", "llama-bf16-ckpt"],
)
def test_extrapolation_matches_a_full_trace(tiny, cfg, setup, micro, seq):
    info = tiny(cfg)
    work = Workload(micro_batch_size=micro, seq_len=seq, device="cpu")
    full = _trace_estimate.estimate_trace(info, setup, work, full_depth=True)
    extrapolated = _trace_estimate.estimate_trace(info, setup, work)
    assert extrapolated.extras["notes"] == [f"traced 1 and 2 layers, extrapolated to {LAYERS}"]
    assert extrapolated.peak_bytes == pytest.approx(full.peak_bytes, rel=0.005)


def test_flash_substitution_saves_output_and_lse_only():
    q = torch.randn(2, 4, 64, 16, requires_grad=True)
    out = FlashAttentionMemory.apply(q, q, q)
    saved = {tuple(t.shape): t.dtype for t in out.grad_fn.saved_tensors if t is not None}
    assert saved == {(2, 4, 64, 16): torch.float32, (2, 4, 64): torch.float32}
    original = torch.nn.functional.scaled_dot_product_attention
    with cuda_kernels():
        assert torch.nn.functional.scaled_dot_product_attention is original  # a mode, no swap
        y = torch.nn.functional.scaled_dot_product_attention(q, q, q, dropout_p=0.1)
        assert y.grad_fn.name().startswith("FlashAttentionMemoryBackward")
    assert torch._C._len_torch_function_stack() == 0  # and gone after the block


def test_cuda_emulation_drops_the_score_matrix(tiny):
    # GPT-2 trains with attention dropout: CPU SDPA stores s x s probabilities, CUDA does not.
    info = tiny(TINY_GPT2)
    kw = {"micro_batch_size": 4, "seq_len": 256, "engine": "trace"}
    cpu = estimate(info, TrainingSetup(precision="fp32"), device="cpu", **kw)
    cuda = estimate(
        info, TrainingSetup(precision="fp32"), device="cuda", gpu=get_gpu("a100-80gb"), **kw
    )
    scores = LAYERS * 4 * 4 * 256 * 256 * 4 * 3  # layers x heads x batch x s^2 x 3 fp32 tensors
    assert cpu.activation_peak_bytes - cuda.activation_peak_bytes >= 0.9 * scores
    assert cuda.reserved_bytes >= cuda.peak_bytes
    assert cuda.device_total_bytes > cuda.reserved_bytes  # + CUDA context


def test_unsupported_setups_fall_back_to_analytic():
    # MoE is traced; fp16 with an fp32 master copy is not yet
    est = estimate(
        resolve_model("gpt2"),
        TrainingSetup(precision="fp16"),
        micro_batch_size=1,
        seq_len=128,
        engine="trace",
    )
    assert est.engine == "analytic" and "DeepSpeed's fp16" in est.warnings[0]
    assert "--precision amp-fp16 (autocast, a GradScaler) is traced" in est.warnings[0]


def test_emulated_optimizers_allocate_like_the_real_ones():
    p = torch.nn.Parameter(torch.zeros(100, 100))
    p.grad = torch.zeros_like(p)
    opt = make_optimizer("adamw-8bit", [p], "auto", emulate_cuda=False)
    opt.step()
    state = opt.state[p]
    assert state["state1"].dtype == torch.uint8 and state["absmax1"].numel() == 40
    small = torch.nn.Parameter(torch.zeros(10))
    small.grad = torch.zeros_like(small)
    opt = make_optimizer("adamw-8bit", [small], "auto", emulate_cuda=False)
    opt.step()
    assert opt.state[small]["state1"].dtype == torch.float32  # under min_8bit_size
    assert make_optimizer("adamw", [p], "auto", emulate_cuda=True).defaults["foreach"] is True
    assert isinstance(
        make_optimizer("adafactor", [p], "auto", False), transformers.optimization.Adafactor
    )


def test_cuda_autocast_policy_survives_checkpoint_recompute(tiny):
    # Torch-function modes are off while backward recomputes a checkpointed layer; the policy
    # is re-entered there (context_fn), else the recompute's dtypes disagree and it raises.
    info = tiny(TINY_GPT2)
    setup = TrainingSetup(precision="amp-fp16", grad_ckpt=True, attention="eager")
    est = estimate(
        info,
        setup,
        micro_batch_size=2,
        seq_len=64,
        device="cuda",
        gpu=get_gpu("v100-16gb"),
        engine="trace",
    )
    assert est.engine == "trace" and est.peak_bytes > 0
