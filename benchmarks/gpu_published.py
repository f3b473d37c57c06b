"""`--gpu` estimates against published GPU measurements (benchmarks/data/gpu_measurements.json).

Each measurement says what was measured: max_memory_allocated is compared with `peak_bytes`,
max_memory_reserved with `reserved_bytes`, nvidia-smi (and "unknown") with `device_total_bytes`.
Frameworks differ (HF Trainer, torchtune, litgpt): their models are not the HF implementation
batchfit traces, so their rows show how far the HF-based estimate travels, not its accuracy.

    python benchmarks/gpu_published.py [--no-write]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from _report import write_section  # noqa: E402

GIB = 1024**3
# The sources' names for what batchfit calls by its own.
OPTIMIZERS = {"adam-8bit": "adamw-8bit", "paged-adamw": "adamw"}
TARGETS = {
    "q": ["q_proj"],
    "v": ["v_proj"],
    "k": ["k_proj"],
    "output_proj": ["o_proj"],
    "mlp": ["gate_proj", "up_proj", "down_proj"],
}
GPUS = {"a100": "a100-80gb"}

# The conventions of the run each row measured, read from the framework's code at the time of
# the measurement (the notes in gpu_measurements.json name the config and commit).
_TORCHTUNE_2024 = {
    # torchtune 42033116 (2024-05): recipes/lora_finetune_single_device.py:476-485 holds
    # `logits` through `loss.backward()`; modules/transformer.py:251 `self.output(h).float()`;
    # configs/llama2/*: torch.nn.CrossEntropyLoss. In memory terms: a keep-outputs loop, the
    # outputs cast to fp32, the full loss (the accelerate preset's conventions), pure bf16.
    "framework": "accelerate",
    "loop": "keep-outputs",
    "loss": "full",
}
_LIT_GPT_2023 = {"framework": "litgpt", "lora_alpha": 16.0, "lora_dropout": 0.05}
# The bert-large V100 rows: HF Trainer of January 2022 (the doc's nvidia-smi reads "Tue Jan 11
# 2022"), so transformers ~4.16 and torch 1.10 (1.11 came out in March 2022).
# transformers v4.16.0 training_args.py:667-668: optim defaults to "adamw_hf", which
# trainer.py:860-864 maps to transformers.optimization.AdamW, a per-parameter loop
# (optimization.py:335, one `denom` temporary a parameter at :361): the for-loop
# implementation. The other two are torch 1.10's, emulated in the dry run (`_torch_1_10`).
_HF_TRAINER_2022 = {"torch": "1.10"}
_HF_TRAINER_2022_ADAMW = {**_HF_TRAINER_2022, "optimizer_impl": "for-loop"}
CONVENTIONS: dict[str, dict[str, Any]] = {
    "hf-bert-large-vanilla-bs4": _HF_TRAINER_2022_ADAMW,
    "hf-bert-large-bs1-ga4": _HF_TRAINER_2022_ADAMW,
    "hf-bert-large-bs1-ga4-gc": _HF_TRAINER_2022_ADAMW,
    "hf-bert-large-bs4-fp16": _HF_TRAINER_2022_ADAMW,
    "hf-bert-large-bs1-ga4-gc-fp16": _HF_TRAINER_2022_ADAMW,
    "hf-bert-large-bs4-adafactor": _HF_TRAINER_2022,
    "hf-bert-large-bs1-ga4-gc-fp16-adafactor": _HF_TRAINER_2022,
    "hf-bert-large-bs4-adam8bit": _HF_TRAINER_2022,
    "hf-bert-large-bs1-ga4-gc-fp16-adam8bit": _HF_TRAINER_2022,
    "torchtune-llama2-7b-qlora-4090": {**_TORCHTUNE_2024, "lora_dtype": "bf16"},
    "torchtune-llama2-7b-lora-4090": {**_TORCHTUNE_2024, "lora_dtype": "bf16"},
    "torchtune-llama2-7b-full-4090": _TORCHTUNE_2024,
    # the notes: "loss CEWithChunkedOutputLoss" (8 chunks), `del logits` before backward
    "torchtune-llama3.1-8b-full-4090": {"framework": "torchtune", "optimizer_impl": "auto"},
    "torchtune-llama3.1-8b-lora-4090": {"framework": "torchtune", "optimizer_impl": "auto"},
    "torchtune-llama3.1-8b-qlora-4090": {"framework": "torchtune", "optimizer_impl": "auto"},
    # "standard cross-entropy (no chunking)"; the later rows add CEWithChunkedOutputLoss
    "torchtune-llama3.2-3b-full-packed-4096-a100": {
        "framework": "torchtune",
        "loss": "full",
        "optimizer_impl": "auto",
    },
    "torchtune-llama3.2-3b-full-packed-compile-chunkedce-ac-a100": {
        "framework": "torchtune",
        "optimizer_impl": "auto",
    },
    "torchtune-llama3.2-3b-lora-packed-4096-a100": {
        "framework": "torchtune",
        "optimizer_impl": "auto",
    },
    "torchtune-llama3.2-3b-qlora-packed-4096-a100": {
        "framework": "torchtune",
        "optimizer_impl": "auto",
    },
    # lit-gpt 8641822 (2023-10) and litgpt's config hub: bf16-true, lm_head_chunk_size=128
    # (LoRA), Fabric casting the outputs to fp32, the logits held through backward; lit-gpt's
    # finetune/lora.py of that month (cf91ad27): lora_alpha = 16, lora_dropout = 0.05
    "litgpt-llama2-7b-lora-mbs1-a100-40gb": _LIT_GPT_2023,
    "litgpt-llama2-7b-lora-mbs2-a100-40gb": _LIT_GPT_2023,
    "litgpt-llama2-7b-qlora-nf4-mbs1-a100-40gb": _LIT_GPT_2023,
    # finetune/full.py: the whole logits, then chunked_cross_entropy over 128-row chunks
    "litgpt-llama3.2-1b-full-a10g": {"framework": "litgpt", "loss": "full"},
    "litgpt-llama3.2-3b-full-a10g": {"framework": "litgpt", "loss": "full"},
    "litgpt-tinyllama-1.1b-full-a10g": {"framework": "litgpt", "loss": "full"},
}


def setup_of(m: dict[str, Any]) -> dict[str, Any]:
    setup: dict[str, Any] = {
        "precision": m["precision"],
        "optimizer": OPTIMIZERS.get(m["optimizer"], m["optimizer"]),
        "method": m["method"],
        "grad_ckpt": bool(m["grad_ckpt"]),
        "attention": m.get("attention", "auto"),
    }
    if m["method"] != "full":
        setup["lora_rank"] = m.get("lora_rank") or 8
        if m.get("lora_targets"):
            names: list[str] = []
            for t in m["lora_targets"]:
                names += TARGETS.get(t, [t])
            setup["lora_targets"] = tuple(dict.fromkeys(names))
    return setup


def conventions(setup: Any, row_id: str) -> Any:
    """``setup`` with the row's framework conventions (``CONVENTIONS``): the preset, then the
    values the row's notes state."""
    from dataclasses import replace

    from batchfit.frameworks import with_framework

    values = dict(CONVENTIONS.get(row_id, {}))
    values.pop("torch", None)  # not a setup field: `_torch_1_10` in `compare`
    framework = values.pop("framework", None)
    if framework is not None:
        setup = with_framework(setup, framework, frozenset(values))
    if "loss" in values:
        values.setdefault("loss_chunk_tokens", None)
    return replace(setup, **values)


@contextlib.contextmanager
def _torch_1_10() -> Iterator[None]:
    """The dry run as torch 1.10 kept memory, where it differs from the installed torch.

    - ``zero_grad`` zeroes the gradients instead of dropping them: torch 1.10's
      ``Module.zero_grad(set_to_none: bool = False)`` (the default became True in torch 2.0,
      pytorch/pytorch#92731), which transformers v4.16.0 trainer.py:1306 and :1435 call
      (``model.zero_grad()``), so the gradients live through every forward.
    - softmax keeps its input for backward: torch 1.10's tools/autograd/derivatives.yaml has
      ``_softmax``'s ``self: _softmax_backward_data(grad, result, dim, self)``, so autograd saved
      ``self`` (the fp32 attention scores, or autocast's fp32 copy of them); the dtype replaced
      it in pytorch/pytorch#66018 (October 2021, after the 1.10 branch; first in 1.11).

    The trace cache is off inside: its records do not know of these patches.
    """
    import torch
    import torch.nn.functional as F

    from batchfit import _cache

    class _KeepInput(torch.autograd.Function):
        @staticmethod
        def forward(ctx: Any, out: torch.Tensor, kept: torch.Tensor) -> torch.Tensor:
            ctx.save_for_backward(kept)
            return out.view_as(out)

        @staticmethod
        def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
            return grad, None

    softmax, opt_zero, module_zero = (
        F.softmax,
        torch.optim.Optimizer.zero_grad,
        torch.nn.Module.zero_grad,
    )

    def softmax_1_10(
        input: torch.Tensor, dim: Any = None, _stacklevel: int = 3, dtype: Any = None
    ) -> torch.Tensor:
        if torch.is_autocast_enabled("cpu") and input.dtype in (torch.float16, torch.bfloat16):
            input = input.float()  # CUDA autocast's fp32 softmax: the cast copy is what is saved
        out = softmax(input, dim=dim, dtype=dtype)
        return _KeepInput.apply(out, input.detach()) if input.requires_grad else out

    F.softmax = softmax_1_10  # type: ignore[assignment]
    torch.optim.Optimizer.zero_grad = lambda self, set_to_none=True: opt_zero(self, False)  # type: ignore[method-assign]
    torch.nn.Module.zero_grad = lambda self, set_to_none=True: module_zero(self, False)  # type: ignore[method-assign]
    try:
        with _cache.disabled():
            yield
    finally:
        F.softmax = softmax  # type: ignore[assignment]
        torch.optim.Optimizer.zero_grad = opt_zero  # type: ignore[method-assign]
        torch.nn.Module.zero_grad = module_zero  # type: ignore[method-assign]


def excluded_why(m: dict[str, Any], info: Any) -> str | None:
    """Rows whose measurement cannot be the stated setup on the device alone."""
    if "paged" in (m.get("optimizer") or ""):
        return "paged optimizer: its states spill to CPU RAM under pressure"
    if m["method"] == "full" and m.get("precision") == "bf16":
        states = 8 * info.total_params  # bf16 weights + gradients + AdamW moments
        if m["value_bytes"] < states:
            return (
                f"measured below the bf16 model states alone ({states / GIB:.1f} GiB): "
                "the run cannot be the stated setup"
            )
    return None


def compare(m: dict[str, Any]) -> dict[str, Any] | None:
    from batchfit.errors import UsageError
    from batchfit.hardware import get_gpu
    from batchfit.memory.estimate import estimate
    from batchfit.models import resolve_model
    from batchfit.spec import TrainingSetup

    if not m.get("micro_batch_size") or not m.get("seq_len") or not m.get("precision"):
        return None
    try:
        info = resolve_model(m["model"], m.get("task"))
    except UsageError:
        return None
    gpu = get_gpu(GPUS.get(m["gpu"], m["gpu"]))
    setup = conventions(TrainingSetup(**setup_of(m)), m["id"])
    out: dict[str, Any] = {"m": m, "excluded": excluded_why(m, info), "setup": setup}
    era = CONVENTIONS.get(m["id"], {}).get("torch") == "1.10"
    for engine in ("trace", "analytic"):
        with _torch_1_10() if era and engine == "trace" else contextlib.nullcontext():
            est = estimate(
                info,
                setup,
                micro_batch_size=m["micro_batch_size"],
                seq_len=m["seq_len"],
                gpu=gpu,
                engine=engine,  # type: ignore[arg-type]
                grad_accum_steps=m.get("grad_accum_steps", 1),
            )
        device_total = est.device_total_bytes
        if m.get("cuda_context_bytes"):  # the source measured its own context: use it
            device_total = est.reserved_bytes + m["cuda_context_bytes"]
        value = {
            "max_memory_allocated": est.peak_bytes,
            "max_memory_reserved": est.reserved_bytes,
        }.get(m["measured"], device_total)
        out[engine] = value
        out[f"{engine}_engine"] = est.engine
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--no-write", action="store_true")
    args = parser.parse_args()
    data = json.loads((HERE / "data" / "gpu_measurements.json").read_text())
    rows = []
    for m in data["measurements"]:
        row = compare(m)
        if row is None:
            print(f"skipped {m['id']}: setup not stated or model not known", flush=True)
            continue
        rows.append(row)
        truth = m["value_bytes"]
        print(
            f"{m['id']:58s} {truth / GIB:6.2f}  trace {row['trace'] / truth - 1:+6.1%}  "
            f"analytic {row['analytic'] / truth - 1:+6.1%}",
            flush=True,
        )
    if not args.no_write:
        write_section("gpu-published", render(rows))
    return 0


def render(rows: list[dict[str, Any]]) -> str:
    lines = [
        "## `--gpu` estimates against published GPU measurements",
        "",
        "Published single-GPU measurements with their sources in "
        "`benchmarks/data/gpu_measurements.json`; compared with the figure of the same kind "
        "(allocated -> `peak_bytes`, reserved -> `reserved_bytes`, nvidia-smi or unknown -> "
        "`device_total_bytes`). Real CUDA steps measured on one H100 are compared further down. "
        "Each row runs with the conventions of its framework at the time it was "
        "measured (loop, loss, adapter dtype, fp32 outputs; `CONVENTIONS` in the "
        "script cites the code each follows). torchtune and litgpt rows still run their own "
        "Llama code, not the HF model batchfit traces, and some torchtune rows compile the model "
        "and offload activations, which batchfit does not model. Produced by "
        "`python benchmarks/gpu_published.py`.",
        "",
        "| id | model | GPU | micro x seq | setup; conventions | measured | published GiB | trace "
        "| analytic |",
        "|---|---|---|---|---|---|---:|---:|---:|",
    ]
    for r in rows:
        m = r["m"]
        s = setup_of(m)
        conv = r["setup"]
        setup = f"{s['precision']} {s['optimizer']} {s['method']}" + (
            " ckpt" if s["grad_ckpt"] else ""
        )
        if conv.framework:
            setup += f"; {conv.framework}: {conv.loop}, loss {conv.loss_label}"
        if CONVENTIONS.get(m["id"], {}).get("torch"):
            setup += "; 2022: " + (
                f"{conv.optimizer_impl} AdamW, " if conv.optimizer_impl != "auto" else ""
            )
            setup += "torch 1.10 (zeroed grads, softmax input kept)"
        truth = m["value_bytes"]
        lines.append(
            f"| {m['id']} | {m['model'].split('/')[-1]} | {m['gpu']} | {m['micro_batch_size']} x "
            f"{m['seq_len']} | {setup} | {m['measured']} | {truth / GIB:.2f} | "
            f"{r['trace'] / GIB:.2f} ({r['trace'] / truth - 1:+.0%})"
            f"{'' if r['trace_engine'] == 'trace' else ' [a]'} | "
            f"{r['analytic'] / GIB:.2f} ({r['analytic'] / truth - 1:+.0%})"
            + (f" [x: {r['excluded']}]" if r["excluded"] else "")
            + " |"
        )
    kept = [r for r in rows if not r["excluded"]]
    for label, subset in (
        ("HF Trainer rows", [r for r in kept if r["m"]["id"].startswith("hf-")]),
        ("rows not excluded [x]", kept),
    ):
        if subset:
            errs = [abs(r["trace"] / r["m"]["value_bytes"] - 1) for r in subset]
            lines.append(
                f"\n{label}: median |error| {statistics.median(errs):.0%}, worst "
                f"{max(errs):.0%} (goal: median 10%, worst 20%)."
            )
    lines.append("\n[a]: the trace does not model this setup yet; the analytic engine answered.")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
