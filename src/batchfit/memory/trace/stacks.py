"""Which models a dry run cuts to a few layers of their stack (torch-free: the estimate reads it
before deciding whether to trace, and the dry run when it builds the model)."""

from __future__ import annotations

from batchfit.models import ModelInfo


def cuttable_vision(model: ModelInfo) -> bool:
    """Whether an image model is one stack of like layers (ViT, DeiT, DINOv2), cut to the
    traced depths as a decoder is. Traced whole: stages of other widths (ConvNeXt, Swin,
    ResNet), towers (CLIP), and stochastic depth (BEiT's ``drop_path_rate``: each layer drops
    its branch at a rate that grows with its index, and the first drops none, so its layers
    differ)."""
    config = model.config
    staged = ("depths", "hidden_sizes", "vision_config", "stage_names")
    if "num_hidden_layers" not in config or any(key in config for key in staged):
        return False
    return not config.get("drop_path_rate")
