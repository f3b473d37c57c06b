"""torchvision's image classifiers by name (``resnet50``, ``vit_b_16``, ``convnext_tiny``, ...).

torchvision is an optional extra (``pip install 'batchfit[vision]'``); a model is built with
``torchvision.models.get_model(name, weights=None, num_classes=N)`` on the meta device, so no
weights are downloaded. Trained as the torchvision reference scripts do: logits, then
cross-entropy against integer labels.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from typing import Any

from batchfit._names import suggest
from batchfit.errors import UsageError

PREFIX = "torchvision:"
DEFAULT_CLASSES = 1000  # ImageNet-1k, the head of every torchvision classifier
DEFAULT_IMAGE_SIZE = 224  # the reference scripts' train crop (most models)


def installed() -> bool:
    """Whether torchvision can be imported (checked without importing it)."""
    return importlib.util.find_spec("torchvision") is not None


def names() -> list[str]:
    """torchvision's classification models (``torchvision.models.list_models``)."""
    # lazy: torchvision and torch (~1 s) load only when a model is built
    import torchvision

    return sorted(torchvision.models.list_models(module=torchvision.models))


def lookup(text: str) -> str | None:
    """The torchvision model ``text`` names (``resnet50`` or ``torchvision:resnet50``), or None.

    Raises:
        UsageError: ``torchvision:NAME`` without torchvision installed, or an unknown NAME.
    """
    explicit = text.startswith(PREFIX)
    name = text.removeprefix(PREFIX).strip()
    if not installed():
        if explicit:
            raise UsageError(
                f"MODEL {text}: torchvision is not installed (pip install 'batchfit[vision]', "
                "or torchvision matching your torch)"
            )
        return None
    try:
        known = names()
    except Exception as e:  # a torchvision that does not match torch fails on import
        if not explicit:
            return None
        raise UsageError(f"MODEL {text}: torchvision does not import here ({e})") from None
    if name in known:
        return name
    if explicit:
        raise UsageError(
            f"MODEL {text}: torchvision has no classifier {name!r}{suggest(name, known)}"
        )
    return None


def config(name: str) -> dict[str, Any]:
    """The config batchfit keeps for a torchvision model (its name and head)."""
    return {
        "model_type": "torchvision",
        "torchvision_name": name,
        "num_labels": DEFAULT_CLASSES,
        "image_size": DEFAULT_IMAGE_SIZE,
        "num_channels": 3,
    }


def build(cfg: dict[str, Any]) -> Any:
    """The model with its loss: ``model(pixel_values=..., labels=...).loss``, as HF models."""
    # lazy: torchvision and torch (~1 s) load only when a model is built
    import torch

    # lazy: torchvision and torch (~1 s) load only when a model is built
    import torchvision

    class Classifier(torch.nn.Module):
        """A torchvision classifier taking ``pixel_values`` and ``labels``; returns the loss
        (the logits die in forward, as in a Trainer loop)."""

        def __init__(self, net: torch.nn.Module) -> None:
            super().__init__()
            self.net = net

        def forward(self, pixel_values: torch.Tensor, labels: torch.Tensor) -> Output:
            logits = self.net(pixel_values)
            if isinstance(logits, tuple):  # Inception / GoogLeNet train with auxiliary logits
                logits = logits[0]
            return Output(torch.nn.functional.cross_entropy(logits, labels))

    net = torchvision.models.get_model(
        cfg["torchvision_name"], weights=None, num_classes=cfg["num_labels"]
    )
    return Classifier(net)


@dataclass
class Output:
    """What the wrapped classifier returns."""

    loss: Any
