"""`make demo`: batchfit's main job on catalog models, offline.

The first run dry-runs the models on fake tensors (about a minute on a 2-core machine); a second
run reads them from the trace cache and takes seconds. The GPU table uses the formulas
(``--engine analytic``): the trace over every catalog GPU is the slow part of a first run.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from batchfit.cli import main


def run(args: list[str]) -> None:
    print(f"\n$ batchfit {' '.join(args)}", flush=True)
    try:
        main(args)
    except SystemExit as e:
        if e.code:
            raise


def demo() -> None:
    print(
        "batchfit demo: four questions a user asks (the README's tour). The first run dry-runs\n"
        "each model's step on fake tensors: about a minute on 2 cores, a line on the terminal\n"
        "naming each dry run; the next run reads the trace cache and takes seconds.",
        flush=True,
    )
    run(
        [
            "estimate",
            "llama-3.1-8b",
            "--micro-batch",
            "1",
            "--seq-len",
            "4096",
            "--precision",
            "bf16",
            "--gpu",
            "h100-80gb",
        ]
    )
    run(
        [
            "plan",
            "llama-3.1-8b",
            "--gpu",
            "a100-40gb",
            "--global-batch-tokens",
            "1048576",
            "--seq-len",
            "4096",
            "--base-lr",
            "3e-4",
            "--base-batch-tokens",
            "524288",
        ]
    )
    out = Path(tempfile.mkdtemp(prefix="batchfit-demo-"))
    run(
        [
            "plan",
            "gpt2",
            "--gpu",
            "rtx-3060",
            "--seq-len",
            "256",
            "--global-batch-tokens",
            "32768",
            "--micro-batch",
            "16",
            "--export",
            "deepspeed",
            "--out",
            str(out / "ds_config.json"),
        ]
    )
    print((out / "ds_config.json").read_text())
    run(["gpus", "bert-base-uncased", "--seq-len", "512", "--engine", "analytic"])


if __name__ == "__main__":
    demo()
