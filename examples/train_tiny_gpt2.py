"""Plan, then train a tiny GPT-2 on the CPU with exact accumulation and OOM recovery.

1. Write a tiny GPT-2 ``config.json`` and plan it like a real run: ``batchfit.plan.make_plan``
   picks the micro-batch and accumulation that reach the global batch on a catalog GPU.
2. Train the model built from that config on the CPU for a few steps with
   ``batchfit.train.Accumulator`` (token-mean loss over padded, variable-length sequences,
   exact across micro-batches) and ``MicroBatcher`` (halves the micro-batch on OOM and redoes
   the global batch). ``--oom-above N`` makes every micro-batch larger than N raise
   ``torch.OutOfMemoryError`` half way through backward, to show the recovery on a machine
   with plenty of memory.

    python examples/train_tiny_gpt2.py --steps 8 --oom-above 4

``--write-config FILE`` writes the model's config.json and exits: ``batchfit estimate FILE
--device cpu -b 16 -s 32 --json`` is then the CPU step this script runs, for ``batchfit
monitor --plan`` (README, "monitor and calibration").
"""

from __future__ import annotations

import argparse
import json
import logging
import tempfile
from pathlib import Path

import torch
from transformers import GPT2Config, GPT2LMHeadModel

from batchfit.hardware import get_gpu
from batchfit.models import resolve_model
from batchfit.plan import make_plan
from batchfit.spec import TrainingSetup
from batchfit.train import Accumulator, MicroBatcher, cross_entropy_sum

CONFIG = {
    "model_type": "gpt2",
    "architectures": ["GPT2LMHeadModel"],
    "vocab_size": 96,
    "n_positions": 64,
    "n_embd": 64,
    "n_layer": 2,
    "n_head": 4,
    "n_inner": 256,
    "bos_token_id": 0,
    "eos_token_id": 0,
}
SEQ_LEN = 32


def synthetic_batch(size: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Counting sequences (start, start+1, ...) of random length, right-padded."""
    starts = torch.randint(0, CONFIG["vocab_size"] - SEQ_LEN, (size, 1), generator=gen)
    ids = starts + torch.arange(SEQ_LEN)
    lengths = torch.randint(SEQ_LEN // 4, SEQ_LEN + 1, (size, 1), generator=gen)
    pad = torch.arange(SEQ_LEN) >= lengths
    labels = ids.masked_fill(pad, -100)
    return ids.masked_fill(pad, 0), labels


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--global-batch", type=int, default=32)
    parser.add_argument("--gpu", default="t4", help="catalog GPU to plan for")
    parser.add_argument("--oom-above", type=int, default=None, help="simulate OOM above this")
    parser.add_argument("--write-config", type=Path, help="write the config.json and exit")
    args = parser.parse_args()
    if args.write_config is not None:
        args.write_config.write_text(json.dumps(CONFIG, indent=2) + "\n")
        return
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    torch.manual_seed(0)

    with tempfile.TemporaryDirectory() as tmp:
        config_path = Path(tmp) / "config.json"
        config_path.write_text(json.dumps(CONFIG))
        info = resolve_model(str(config_path))
        plan = make_plan(
            info,
            get_gpu(args.gpu),
            TrainingSetup(),
            seq_len=SEQ_LEN,
            global_batch=args.global_batch,
        )
        model = GPT2LMHeadModel(GPT2Config.from_json_file(str(config_path)))
    print(
        f"plan on {plan.gpu}: micro-batch {plan.micro_batch_size} x accumulation "
        f"{plan.grad_accum_steps} = global batch {plan.global_batch_size}; "
        f"peak {plan.estimate.peak_bytes / 2**20:.0f} MiB of {plan.gpu_bytes / 2**30:.0f} GiB"
    )

    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: min(1.0, (step + 1) / 3))
    acc = Accumulator(model, optimizer, scheduler=scheduler, max_grad_norm=1.0)
    # Start from the plan's micro-batch, capped so this CPU run has several micro-steps.
    batcher = MicroBatcher(acc, min(plan.micro_batch_size, args.global_batch // 2))

    def step_fn(micro: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        ids, labels = micro
        logits = model(ids).logits[:, :-1]
        if args.oom_above is not None and len(ids) > args.oom_above:
            logits.register_hook(_simulated_oom)
        return cross_entropy_sum(logits, labels[:, 1:])

    gen = torch.Generator().manual_seed(1)
    model.train()
    losses = []
    for step in range(args.steps):
        result = batcher.run(synthetic_batch(args.global_batch, gen), step_fn)
        losses.append(result.loss)
        print(
            f"step {step}: loss {result.loss:.3f} over {result.num_items:.0f} tokens, "
            f"micro-batch {result.micro_batch_size} x {result.micro_steps}, "
            f"grad norm {result.grad_norm:.2f}, OOMs recovered {result.ooms}"
        )
    print(f"loss {losses[0]:.3f} -> {losses[-1]:.3f}; OOMs recovered in all: {batcher.num_ooms}")


def _simulated_oom(grad: torch.Tensor) -> None:
    raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 1.00 GiB (simulated)")


if __name__ == "__main__":
    main()
