"""Which models a dry run cuts to a few layers of their stack (torch-free: the estimate reads it
before deciding whether to trace, and the dry run when it builds the model)."""

from __future__ import annotations

from batchfit.models import ModelInfo

# image model types built as one stack of ``num_hidden_layers`` like layers
CUT_IMAGE_TYPES = ("vit", "deit", "dinov2")


def cuttable_vision(model: ModelInfo) -> bool:
    """Whether an image model is one stack of like layers whose depth its config sets (ViT,
    DeiT, DINOv2), cut to the traced depths as a decoder is. Traced whole: every other image
    model (stages of other widths: ConvNeXt, Swin, ResNet; EfficientNet, whose
    ``num_hidden_layers`` its blocks never read; CLIP's towers) and stochastic depth (BEiT's
    ``drop_path_rate``: each layer drops its branch at its own rate, the first none, so its
    layers differ)."""
    config = model.config
    if config.get("model_type") not in CUT_IMAGE_TYPES or "num_hidden_layers" not in config:
        return False
    return not config.get("drop_path_rate")
