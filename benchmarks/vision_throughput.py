"""Image models' step time against published training throughput (held out).

timm's published training benchmark on one RTX 3090 (``results/benchmark-train-amp-nchw-pt112-
cu113-rtx3090.csv`` in huggingface/pytorch-image-models at commit 5e7d47c): samples a second
of ``benchmark.py``'s ``TrainBenchmarkRunner`` (PyTorch 1.12, CUDA 11.3, fp16 autocast, NCHW,
cross-entropy, ``create_optimizer_v2(opt="sgd")``: SGD with Nesterov momentum 0.9, one
optimizer step per batch, no accumulation) for every catalog image model the table has. Each
is predicted by ``estimate --gpu rtx-3090`` at the benchmark's batch (amp-fp16, sgd-momentum):
the step timed from the FLOPs its dry run counts. The rows were fixed, and the time model for
image models written, before any prediction was compared; no coefficient was changed after.

    python benchmarks/vision_throughput.py [--no-write]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "src"))
from _report import write_section  # noqa: E402

SOURCE = (
    "https://github.com/huggingface/pytorch-image-models/blob/"
    "5e7d47ca105a59a39778102d3276291d6db5dd32/results/"
    "benchmark-train-amp-nchw-pt112-cu113-rtx3090.csv"
)
# (catalog name, timm name, the benchmark's batch, its published samples a second)
PUBLISHED = [
    ("vit-base-patch16-224", "vit_base_patch16_224", 192, 390.86),
    ("vit-large-patch16-224", "vit_large_patch16_224", 64, 117.08),
    ("deit-base-patch16-224", "deit_base_patch16_224", 192, 390.88),
    ("beit-base-patch16-224", "beit_base_patch16_224", 192, 358.29),
    ("convnext-tiny-224", "convnext_tiny", 256, 813.16),
    ("convnext-base-224", "convnext_base", 128, 336.98),
    ("swin-tiny-patch4-window7-224", "swin_tiny_patch4_window7_224", 256, 646.76),
    ("resnet-50", "resnet50", 512, 826.06),
]


# The evaluation set, fixed before any of it was predicted: every model of the same table
# whose architecture transformers builds from a config (its own config written here, the
# timm model's published shape), beyond the catalog's: ViT-S/16 and ViT-B/32, ConvNeXt-S and
# -L, Swin-S and -B, ResNet-18, -34, -101 and -152 (DeiT-S is ViT-S/16's twin).
_RESNET = {"model_type": "resnet", "embedding_size": 64, "num_labels": 1000}
_BASIC = {**_RESNET, "layer_type": "basic", "hidden_sizes": [64, 128, 256, 512]}
_BOTTLENECK = {**_RESNET, "layer_type": "bottleneck", "hidden_sizes": [256, 512, 1024, 2048]}


def _vit(width: int, heads: int, patch: int) -> dict[str, object]:
    return {
        "model_type": "vit",
        "image_size": 224,
        "num_hidden_layers": 12,
        "hidden_size": width,
        "num_attention_heads": heads,
        "intermediate_size": 4 * width,
        "patch_size": patch,
        "num_labels": 1000,
    }


def _convnext(widths: list[int]) -> dict[str, object]:
    return {"model_type": "convnext", "depths": [3, 3, 27, 3], "hidden_sizes": widths,
            "num_labels": 1000}  # fmt: skip


def _swin(width: int, heads: list[int]) -> dict[str, object]:
    return {"model_type": "swin", "image_size": 224, "patch_size": 4, "window_size": 7,
            "embed_dim": width, "depths": [2, 2, 18, 2], "num_heads": heads,
            "num_labels": 1000}  # fmt: skip


EVALUATION = [
    ("vit_small_patch16_224", _vit(384, 6, 16), 384, 1052.92),
    ("vit_base_patch32_224", _vit(768, 12, 32), 512, 1703.57),
    ("convnext_small", _convnext([96, 192, 384, 768]), 192, 489.81),
    ("convnext_large", _convnext([192, 384, 768, 1536]), 96, 187.01),
    ("swin_small_patch4_window7_224", _swin(96, [3, 6, 12, 24]), 192, 399.67),
    ("swin_base_patch4_window7_224", _swin(128, [4, 8, 16, 32]), 128, 279.66),
    ("resnet18", {**_BASIC, "depths": [2, 2, 2, 2]}, 512, 2764.22),
    ("resnet34", {**_BASIC, "depths": [3, 4, 6, 3]}, 512, 1622.41),
    ("resnet101", {**_BOTTLENECK, "depths": [3, 4, 23, 3]}, 256, 568.98),
    ("resnet152", {**_BOTTLENECK, "depths": [3, 8, 36, 3]}, 192, 370.08),
]


def predict(name: str, batch: int) -> tuple[float, float]:
    """(predicted samples a second, counted forward GFLOPs a sample) by ``estimate``; ``name``
    a catalog name or a config.json path."""
    import batchfit
    from batchfit.models import resolve_model

    model = resolve_model(name, task="image-classification")
    setup = batchfit.TrainingSetup(precision="amp-fp16", optimizer="sgd-momentum")
    est = batchfit.estimate(
        model, setup, micro_batch_size=batch, seq_len=224, gpu=batchfit.get_gpu("rtx-3090")
    )
    speed = est.speed_json()
    forward = est.extras["flops_per_sample"][0] / 1e9
    return batch / speed["step_seconds"], forward


# The catalog rows' errors of the first version (matmuls, convolutions and attention only, at
# the language models' width-scaled utilisation), measured before the other operators' memory
# traffic was counted: those rows were held out then, and are the debug set since.
FIRST = {
    "vit-base-patch16-224": -0.266,
    "vit-large-patch16-224": -0.365,
    "deit-base-patch16-224": -0.266,
    "beit-base-patch16-224": -0.200,
    "convnext-tiny-224": 0.670,
    "convnext-base-224": 0.111,
    "swin-tiny-patch4-window7-224": 1.265,
    "resnet-50": 1.283,
}


def _rows(cases: list[tuple[str, str, int, float]], first: bool) -> tuple[list[str], list[float]]:
    head = "| model (timm) | batch | published img/s | predicted img/s | error |"
    rows = [
        head + (" first version |" if first else "") + " counted GFLOPs a forward |",
        "|---|---:|---:|---:|---:|" + ("---:|" if first else "") + "---:|",
    ]
    errors = []
    for label, name, batch, published in cases:
        predicted, forward = predict(name, batch)
        error = predicted / published - 1
        errors.append(error)
        print(label, round(predicted, 1), f"{error:+.1%}", flush=True)
        then = f" {FIRST[name]:+.1%} |" if first else ""
        rows.append(
            f"| {label} | {batch} | {published:,.1f} | {predicted:,.1f} | {error:+.1%} |"
            f"{then} {forward:.2f} |"
        )
    return rows, errors


def _summary(errors: list[float]) -> str:
    return (
        f"median |error| {statistics.median(abs(e) for e in errors):.0%}, worst "
        f"{max(errors, key=abs):+.0%} ({len(errors)} models; positive: predicted faster than "
        "published)"
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--no-write", action="store_true")
    args = ap.parse_args()
    os.environ["BATCHFIT_CACHE_DIR"] = tempfile.mkdtemp(prefix="vision-throughput-")
    folder = Path(tempfile.mkdtemp(prefix="vision-configs-"))
    evaluation = []
    for timm, config, batch, published in EVALUATION:
        path = folder / timm / "config.json"
        path.parent.mkdir()
        path.write_text(json.dumps(config))
        evaluation.append((f"`{timm}` (its config)", str(path), batch, published))
    debug = [(f"{name} (`{timm}`)", name, batch, pub) for name, timm, batch, pub in PUBLISHED]
    debug_rows, debug_errors = _rows(debug, first=True)
    eval_rows, eval_errors = _rows(evaluation, first=False)
    first = list(FIRST.values())
    text = "\n".join(
        [
            "## Image models' step time against published training throughput",
            "",
            f"[timm's training benchmark on one RTX 3090]({SOURCE}) (PyTorch 1.12, fp16 "
            "autocast, NCHW, SGD with Nesterov momentum, one step per batch) against `estimate "
            "--gpu rtx-3090` at its batch (amp-fp16, sgd-momentum): the step timed from what "
            "the dry run counts, operator class by operator class (matmuls, convolutions and "
            "attention at the generation's utilisation ceiling, every other operator's bytes "
            "over 80% of the card's bandwidth, a launch cost per layer, the optimizer as "
            "memory traffic). No coefficient was fitted on these rows.",
            "",
            "**Debug set**: the eight catalog image models the table has. They were held out "
            "for the first version, which timed the matmuls, convolutions and attention "
            "alone at the language models' width-scaled utilisation: "
            + _summary(first)
            + ", convolutional models and Swin far too fast, ViTs too slow. Counting the other "
            "operators' memory traffic (a change of structure, made after those errors were "
            "seen) gives the column `error`:",
            "",
            *debug_rows,
            "",
            "Debug set, as now: " + _summary(debug_errors) + ".",
            "",
            "**Evaluation set**, fixed (every model of the table transformers builds from a "
            "config, beyond the catalog's) before any of it was predicted, after the change "
            "above:",
            "",
            *eval_rows,
            "",
            "Evaluation set: " + _summary(eval_errors) + ".",
        ]
    )
    print(text)
    if not args.no_write:
        held = (
            "the evaluation set (ten models of the same table, their configs written from the "
            "timm models' published shapes) was fixed before any of it was predicted and "
            "after the last change to the time model; the eight catalog rows are the debug "
            "set (held out for the first version, seen before the memory traffic was counted)."
        )
        write_section("vision_throughput", text, held_out=held)


if __name__ == "__main__":
    main()
