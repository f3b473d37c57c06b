"""Image models: --task image-classification with --image-size, the catalog's
vision models, torchvision by name, and BatchNorm warnings on every path that picks a size."""

from __future__ import annotations

import json
import re
import sys
import textwrap

import pytest
import torch

from batchfit.errors import UsageError
from batchfit.hardware import get_gpu
from batchfit.memory.estimate import estimate
from batchfit.models import resolve_model
from batchfit.plan import make_plan
from batchfit.spec import TrainingSetup
from tests._cli import run_cli
from tests._tiny import TINY_VIT
from tests.memory._dry_vs_real import assert_dry_run_matches_real

VIT = TINY_VIT
RESNET = {
    "model_type": "resnet",
    "architectures": ["ResNetForImageClassification"],
    "embedding_size": 16,
    "hidden_sizes": [16, 32],
    "depths": [1, 1],
    "layer_type": "basic",
    "num_labels": 10,
}
CONVNEXT = {
    "model_type": "convnext",
    "hidden_sizes": [16, 32],
    "depths": [1, 1],
    "num_stages": 2,
    "num_labels": 10,
}
SWIN = {
    "model_type": "swin",
    "embed_dim": 16,
    "depths": [1, 1],
    "num_heads": [1, 2],
    "window_size": 4,
    "image_size": 64,
    "num_labels": 10,
}


def _config(tmp_path, cfg, name="config.json"):
    path = tmp_path / name
    path.write_text(json.dumps(cfg))
    return str(path)


@pytest.fixture(scope="module")
def convnext(tmp_path_factory):
    """The two-stage ConvNeXt at one path for the file: a dry run is cached under the model's
    path, so the sizes that both of its plans try are traced once."""
    return resolve_model(_config(tmp_path_factory.mktemp("convnext"), CONVNEXT))


VISION_CATALOG = [
    "vit-base-patch16-224",
    "vit-large-patch16-224",
    "deit-base-patch16-224",
    "convnext-tiny-224",
    "swin-tiny-patch4-window7-224",
    "clip-vit-base-patch32",
    "dinov2-base",
    "beit-base-patch16-224",
    "resnet-50",
]


@pytest.mark.parametrize("name", VISION_CATALOG)
def test_catalog_vision_models_are_image_classifiers(name):
    info = resolve_model(name)
    assert info.task == "image-classification"
    assert info.arch.family == "vision"
    assert info.arch.image_size >= 224 and info.arch.num_channels == 3
    assert info.total_params > 20_000_000


def test_the_published_sizes_hold():
    # the model cards' rounded figures (ViT-B 86M, ViT-L 304M, ConvNeXt-T 28M, Swin-T 28M,
    # ResNet-50 25.6M), each with a 1000-class head
    expected = {
        "vit-base-patch16-224": 86.6e6,
        "vit-large-patch16-224": 304.3e6,
        "convnext-tiny-224": 28.6e6,
        "swin-tiny-patch4-window7-224": 28.3e6,
        "resnet-50": 25.6e6,
    }
    for name, params in expected.items():
        assert resolve_model(name).total_params == pytest.approx(params, rel=0.01), name


@pytest.mark.parametrize(
    ("cfg", "setup"),
    [
        (VIT, TrainingSetup(precision="fp32")),
        (VIT, TrainingSetup(precision="amp-bf16", method="lora", grad_ckpt=True)),
        (RESNET, TrainingSetup(precision="fp32", optimizer="sgd-momentum")),
        (CONVNEXT, TrainingSetup(precision="fp32")),
        (SWIN, TrainingSetup(precision="fp32")),
    ],
    ids=["vit", "vit-lora-ckpt", "resnet", "convnext", "swin"],
)
def test_dry_run_matches_a_real_cpu_step(tmp_path, cfg, setup):
    info = resolve_model(_config(tmp_path, cfg))
    assert info.task == "image-classification"
    # Swin: at the top layer's start of backward the dry run holds 1.3% more than the real
    # step (a transient of the window attention's backward, larger on fake tensors; seen at
    # 64 and 224 px alike), on the safe side; every other moment is exact
    rel = 0.02 if cfg is SWIN else 0.01
    assert_dry_run_matches_real(info, setup, micro=4, seq=64, rel=rel)


def test_image_size_resizes_the_position_table_and_grows_activations(tmp_path):
    info = resolve_model(_config(tmp_path, VIT))
    at = {
        size: estimate(info, TrainingSetup(), micro_batch_size=4, seq_len=size, device="cpu")
        for size in (64, 128)
    }
    # 4x the patches: the activations grow about 4x, the position table too
    assert at[128].components["activations"] > 3 * at[64].components["activations"]
    assert at[128].components["weights"] > at[64].components["weights"]
    assert any("position table is resized" in w for w in at[128].warnings)
    assert not any("position table" in w for w in at[64].warnings)


def test_formulas_refuse_image_models(tmp_path):
    info = resolve_model(_config(tmp_path, VIT))
    with pytest.raises(UsageError, match="image model"):
        estimate(info, TrainingSetup(), micro_batch_size=2, seq_len=64, engine="analytic")


def test_checkpointing_a_convnet_is_refused_and_the_plan_skips_it(convnext):
    info = convnext
    assert not info.supports_grad_ckpt
    with pytest.raises(UsageError, match="grad_ckpt"):
        estimate(info, TrainingSetup(grad_ckpt=True), micro_batch_size=2, seq_len=64)
    p = make_plan(info, get_gpu("t4"), TrainingSetup(), seq_len=64, global_batch=64)
    assert p.fits and "gradient-checkpointing" not in [t.name for t in p.techniques]
    assert p.tokens_per_step is None
    assert p.to_json()["image_size"] == 64 and p.to_json()["seq_len"] is None


@pytest.mark.parametrize(
    ("name", "supported"), [("vit-base-patch16-224", True), ("resnet-50", False)]
)
def test_whether_an_image_model_checkpoints_is_read_once_then_cached(
    name, supported, tmp_path, monkeypatch
):
    """transformers answers it from the model's class (importing it costs seconds): a warm
    plan of an image model asks the cache instead."""
    from batchfit.models import _meta

    monkeypatch.setenv("BATCHFIT_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("BATCHFIT_NO_CACHE", raising=False)
    assert resolve_model(name).supports_grad_ckpt is supported

    def unreachable(*_args):
        raise AssertionError("transformers was asked again")

    monkeypatch.setattr(_meta, "model_class", unreachable)
    assert resolve_model(name).supports_grad_ckpt is supported


def test_vision_plan_needs_the_ladder_without_checkpointing_when_unsupported(convnext):
    # A two-stage ConvNeXt at 64 px on a T4 with micro-batch 65,536 does not fit as given: the
    # ladder is walked, and never offers checkpointing (transformers cannot checkpoint ConvNeXt)
    p = make_plan(
        convnext,
        get_gpu("t4"),
        TrainingSetup(),
        seq_len=64,
        global_batch=1 << 16,
        micro_batch_size=1 << 16,
    )
    assert p.alternatives
    assert "gradient-checkpointing" not in [t.name for t in p.techniques]
    assert all(
        "gradient-checkpointing" not in [t.name for t in a.techniques] for a in p.alternatives
    )


def test_cli_estimate_of_a_catalog_vit_and_plan_of_a_vit(tmp_path, capsys):
    code, out, _ = run_cli(
        ["estimate", "vit-base-patch16-224", "-b", "8", "--gpu", "t4", "--json"], capsys
    )
    assert code == 0
    data = json.loads(out)
    assert (data["seq_len"], data["image_size"], data["engine"]) == (None, 224, "trace")
    # the plan of a ViT whose config says 64 px (a catalog ViT's plan dry-runs 12 layers at
    # each size it traces: a minute and more on 2 cores)
    vit = _config(tmp_path, VIT)
    code, out, _ = run_cli(["plan", vit, "--gpu", "t4", "--global-batch", "256", "--json"], capsys)
    assert code == 0
    data = json.loads(out)
    assert data["tokens_per_step"] is None and data["image_size"] == 64
    assert data["micro_batch_size"] * data["grad_accum_steps"] == 256
    # each option is timed, and its throughput counts images (256 a step), not pixels
    timed = [a for a in data["alternatives"] if a["step_seconds"]]
    assert timed and all(
        a["tokens_per_s_per_gpu"] == pytest.approx(256 / a["step_seconds"]) for a in timed
    )
    code, out, _ = run_cli(["plan", vit, "--gpu", "t4", "--global-batch", "256"], capsys)
    assert code == 0 and "image 64 px" in out and "tokens per step" not in out
    # timed from the FLOPs its dry runs counted, in images a second
    assert re.search(r"time: ~[\d.]+ s per optimizer step, [\d,]+ images/s per GPU", out), out
    # an option whose search stopped at the per-GPU batch says so
    capped = [a for a in data["alternatives"] if a["max_micro_batch"] == 256]
    assert capped and "256 (batch)" in out and "no larger size searched" in out
    # checkpointing takes all 256: checkpointing + 8-bit AdamW (another optimizer: it changes
    # training, is never chosen over an exact rung that fits, cannot take more) is left out
    names = [a["techniques"] for a in data["alternatives"]]
    assert ["gradient-checkpointing"] in names
    assert not any("gradient-checkpointing" in n and "adamw-8bit" in n for n in names), names


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["estimate", "vit-base-patch16-224", "-b", "2", "--seq-len", "128"], "--image-size"),
        (["estimate", "gpt2", "-b", "2", "--image-size", "224"], "--seq-len"),
        (["estimate", "vit-base-patch16-224", "-b", "2", "--image-size", "0"], "positive"),
        (["estimate", "vit-base-patch16-224", "-b", "2", "--image-size", "8"], "patches"),
        (
            ["estimate", "vit-base-patch16-224", "-b", "2", "--engine", "analytic"],
            "image model",
        ),
        (
            ["plan", "vit-base-patch16-224", "--gpu", "t4", "--global-batch-tokens", "4096"],
            "--global-batch",
        ),
        (["estimate", "gpt2", "-b", "2", "-s", "64", "--task", "image-classification"], "image"),
        (["estimate", "convnext-tiny-224", "-b", "2", "--grad-ckpt"], "--grad-ckpt"),
        (["estimate", "vit-base-patch16-224", "-b", "2", "--loss", "chunked"], "--loss full"),
        (["estimate", "torchvision:resnet50", "-b", "2"], "torchvision"),
    ],
)
def test_bad_image_input_is_one_line(args, message, capsys, monkeypatch):
    monkeypatch.setattr("batchfit.models._torchvision.installed", lambda: False)
    code, _, err = run_cli(args, capsys)
    assert code == 2, err
    assert message in err and len(err.strip().splitlines()) == 1 and "Traceback" not in err


def test_batchnorm_warns_in_estimate_plan_and_search(tmp_path):
    from batchfit.search import find_batch_size

    info = resolve_model(_config(tmp_path, RESNET))
    est = estimate(info, TrainingSetup(), micro_batch_size=4, seq_len=64, device="cpu")
    assert any("BatchNorm" in w for w in est.warnings)
    big = estimate(info, TrainingSetup(), micro_batch_size=16, seq_len=64, device="cpu")
    assert not any("BatchNorm" in w for w in big.warnings)
    p = make_plan(
        info, get_gpu("t4"), TrainingSetup(), seq_len=64, global_batch=64, micro_batch_size=8
    )
    assert any("BatchNorm" in w for w in p.warnings)

    net = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.BatchNorm1d(8))
    opt = torch.optim.SGD(net.parameters(), lr=0.1)

    def step(x):
        opt.zero_grad(set_to_none=True)
        net(x).square().mean().backward()
        opt.step()

    # BatchNorm in training refuses a batch of one: the search starts at 2
    small = find_batch_size(
        step, lambda n: torch.randn(n, 8), low=2, high=4, model=net, optimizer=opt
    )
    assert any("BatchNorm" in n for n in small.notes)
    plain = torch.nn.Linear(8, 8)
    opt = torch.optim.SGD(plain.parameters(), lr=0.1)

    def plain_step(x):
        opt.zero_grad(set_to_none=True)
        plain(x).square().mean().backward()
        opt.step()

    result = find_batch_size(plain_step, lambda n: torch.randn(n, 8), high=4, model=plain)
    assert not any("BatchNorm" in n for n in result.notes)


FAKE_TORCHVISION = textwrap.dedent(
    """
    import torch

    def _small_cnn(num_classes):
        return torch.nn.Sequential(
            torch.nn.Conv2d(3, 8, 3, padding=1), torch.nn.BatchNorm2d(8), torch.nn.ReLU(),
            torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten(), torch.nn.Linear(8, num_classes),
        )

    _MODELS = {"tinynet": _small_cnn}

    def list_models(module=None):
        return sorted(_MODELS)

    def get_model(name, weights=None, num_classes=1000):
        assert weights is None
        return _MODELS[name](num_classes)
    """
)


@pytest.fixture
def fake_torchvision(tmp_path, monkeypatch):
    """A stand-in torchvision package with torchvision's model-registry API (``list_models``,
    ``get_model(name, weights=None, num_classes=N)``): the real one does not import beside
    the CPU torch 2.13 build this suite runs on."""
    package = tmp_path / "fake_site" / "torchvision"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("from torchvision import models\n")
    (package / "models.py").write_text(FAKE_TORCHVISION)
    monkeypatch.syspath_prepend(str(tmp_path / "fake_site"))
    for mod in [m for m in sys.modules if m == "torchvision" or m.startswith("torchvision.")]:
        monkeypatch.delitem(sys.modules, mod)
    yield
    for mod in [m for m in sys.modules if m == "torchvision" or m.startswith("torchvision.")]:
        del sys.modules[mod]


def test_torchvision_models_by_name(fake_torchvision, capsys):
    info = resolve_model("tinynet")
    assert info.name == "torchvision:tinynet" and info.task == "image-classification"
    assert info.total_params == 3 * 8 * 9 + 8 + 2 * 8 + 8 * 1000 + 1000
    assert resolve_model("torchvision:tinynet").total_params == info.total_params
    assert not info.supports_grad_ckpt
    assert_dry_run_matches_real(info, TrainingSetup(precision="fp32"), micro=4, seq=32)
    code, out, err = run_cli(["estimate", "torchvision:tinynet", "-b", "4", "--json"], capsys)
    assert code == 0, err
    data = json.loads(out)
    assert data["image_size"] == 224 and any("BatchNorm" in w for w in data["warnings"])
    code, _, err = run_cli(["estimate", "torchvision:nosuchnet", "-b", "4"], capsys)
    assert code == 2 and "tinynet" in err  # the suggestion names the real ones


SWIN_TINY = {
    "model_type": "swin",
    "architectures": ["SwinForImageClassification"],
    "embed_dim": 16,
    "depths": [1, 1],
    "num_heads": [2, 4],
    "window_size": 4,
    "image_size": 32,
    "patch_size": 4,
    "num_labels": 10,
}


@pytest.mark.slow
def test_swin_lora_with_checkpointing_is_traced(tmp_path, capsys):
    # peft hooked transformers' make_inputs_require_grads, which breaks on Swin's tuple output
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps(SWIN_TINY))
    args = ["estimate", str(cfg), "-b", "2", "--image-size", "32", "--gpu", "t4"]
    code, out, err = run_cli([*args, "--method", "lora", "--grad-ckpt", "--json"], capsys)
    assert code == 0, err
    assert json.loads(out)["engine"] == "trace"


@pytest.mark.parametrize("model", ["convnext-tiny-224", "resnet-50"])
def test_image_smaller_than_the_downsampling_is_one_line(model, capsys):
    code, _, err = run_cli(["estimate", model, "-b", "2", "--image-size", "31"], capsys)
    assert code == 2
    assert "use at least 32 pixels" in err
    assert "Traceback" not in err
