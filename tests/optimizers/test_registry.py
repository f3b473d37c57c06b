"""Every registered optimizer is registered completely, and its parts agree with each other.

The formula's state is checked against the state the optimizer the dry run builds really
allocates, on tensors of every kind the formulas see (a matrix, a large matrix, a vector);
the names it exports are names transformers knows; the planner never offers a sharding the
optimizer refuses; the docs' table lists exactly the registered optimizers.
"""

from __future__ import annotations

import re
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from batchfit.errors import UsageError
from batchfit.hardware import get_gpu
from batchfit.models import resolve_model
from batchfit.optimizers import OPTIMIZERS, ParamTensor, StepContext, get_optimizer, register
from batchfit.optimizers import base as registry
from batchfit.plan._ladder import apply, ladder
from batchfit.spec import TrainingSetup

DOCS = Path(__file__).resolve().parents[2] / "docs" / "how-we-count.md"
# a vector, a matrix under bitsandbytes' 4096-element 8-bit threshold, a large matrix
SHAPES = ((64,), (16, 48), (96, 80))


def _real_state_bytes(optimizer: torch.optim.Optimizer) -> int:
    """Bytes of the tensors the optimizer keeps per parameter (its step counters excluded)."""
    return sum(
        value.numel() * value.element_size()
        for state in optimizer.state.values()
        for value in state.values()
        if isinstance(value, torch.Tensor) and value.dim() > 0
    )


@pytest.mark.parametrize("name", OPTIMIZERS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_formula_state_is_what_the_built_optimizer_allocates(name: str, dtype: torch.dtype):
    spec = get_optimizer(name)
    params = [torch.nn.Parameter(torch.randn(shape, dtype=dtype)) for shape in SHAPES]
    for p in params:
        p.grad = torch.randn_like(p)
    opt = spec.make(params, "auto", on_cuda=False)
    opt.step()
    elem = params[0].element_size()
    formula = spec.state_bytes([ParamTensor(s) for s in SHAPES], state_elem=elem)
    assert formula == _real_state_bytes(opt)


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_every_part_is_given(name: str):
    spec = get_optimizer(name)
    assert spec.summary and spec.state_text.format(elem=4)
    tensors = [ParamTensor(s, 2, "mlp") for s in SHAPES]
    for impl in spec.impls:
        temps, why = spec.temporaries(StepContext(tensors, impl, 4, 4))
        assert temps >= 0 and why
    accesses = spec.accesses
    assert min(accesses.kernel, accesses.cpu) > 0
    # torch's foreach and loop have their own count; one implementation has one count
    assert (accesses.unfused is None) == ("foreach" not in spec.impls)
    assert spec.lr.scaling in ("linear", "sqrt")
    assert spec.lr.source or spec.lr.unsourced_why
    if spec.lighter is not None:
        lighter = get_optimizer(spec.lighter)
        big = [ParamTensor((4096, 4096))]
        assert lighter.state_bytes(big, 4) < spec.state_bytes(big, 4)


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_exported_names_are_names_transformers_knows(name: str):
    from transformers.training_args import OptimizerNames

    known = {o.value for o in OptimizerNames}
    names = get_optimizer(name).export
    if names.hf_optim is None:  # only where transformers really has no name for it
        assert not any(name.replace("-", "_") in value for value in known)
    else:
        assert names.hf_optim in known
    assert names.hf_optim_fused is None or names.hf_optim_fused in known


def test_an_unknown_optimizer_is_one_line_naming_the_choices():
    with pytest.raises(UsageError, match=r"optimizer 'no-such-optimizer' is not one of: sgd, "):
        TrainingSetup(optimizer="no-such-optimizer")
    with pytest.raises(UsageError, match="adamw"):
        get_optimizer("no-such-optimizer")


def test_a_name_registers_once():
    with pytest.raises(ValueError, match="registered twice"):
        register(get_optimizer("adamw"))


@pytest.fixture
def unsharded_only(monkeypatch: pytest.MonkeyPatch) -> str:
    """An AdamW registered as 'adamw-local' that refuses every sharding but DDP's."""
    spec = replace(get_optimizer("adamw"), name="adamw-local", shardings=frozenset({"none", "ddp"}))
    monkeypatch.setitem(registry._REGISTRY, spec.name, spec)
    return spec.name


def test_the_setup_refuses_a_sharding_the_optimizer_does_not_run_under(unsharded_only: str):
    TrainingSetup(optimizer=unsharded_only, sharding="ddp", num_gpus=2)
    with pytest.raises(UsageError, match="does not run under sharding zero2: use one of ddp, none"):
        TrainingSetup(optimizer=unsharded_only, sharding="zero2", num_gpus=2)


def test_the_ladder_offers_no_sharding_the_optimizer_refuses(unsharded_only: str):
    setup = TrainingSetup(optimizer=unsharded_only, num_gpus=8)
    combos = ladder(setup, get_gpu("a100-80gb"), resolve_model("gpt2"))
    shardings = {apply(setup, combo).sharding for combo in combos}
    assert shardings == {"none"}
    adamw = replace(setup, optimizer="adamw")
    everything = ladder(adamw, get_gpu("a100-80gb"), resolve_model("gpt2"))
    assert {apply(adamw, c).sharding for c in everything} > {"none"}  # AdamW shards


def test_the_docs_table_lists_every_registered_optimizer():
    text = DOCS.read_text(encoding="utf-8")
    rows = re.findall(
        r"^\| `([a-z0-9-]+)` \| (.+?) \| (linear|square root), (.+?) \| `?(\w+)`? \|$",
        text,
        flags=re.MULTILINE,
    )
    assert [row[0] for row in rows] == list(OPTIMIZERS)
    for name, state, scaling, source, hf_optim in rows:
        spec = get_optimizer(name)
        assert state == spec.state_text.replace("{elem}", "s")
        assert scaling == {"linear": "linear", "sqrt": "square root"}[spec.lr.scaling]
        assert source == (spec.lr.source or "no published rule")
        assert hf_optim == (spec.export.hf_optim or "none")
