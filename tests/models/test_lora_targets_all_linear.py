"""``--lora-targets all-linear``: peft's shorthand for every linear module but the output head."""

from __future__ import annotations

import json

from batchfit.models import resolve_model
from tests._cli import run_cli


def test_all_linear_is_every_linear_module_but_the_head(capsys) -> None:
    llama = resolve_model("llama-3.2-1b")
    names = llama.lora_target_names(["all-linear"])
    assert names == ("down_proj", "gate_proj", "k_proj", "o_proj", "q_proj", "up_proj", "v_proj")
    assert llama.lora_params(8, ["all-linear"]) == llama.lora_params(8, names)
    base = ["estimate", "llama-3.2-1b", "-b", "2", "-s", "128", "--method", "lora", "--json"]
    code, out, err = run_cli(
        [*base, "--lora-targets", "all-linear", "--engine", "analytic"], capsys
    )
    assert code == 0, err
    spelled = ",".join(names)
    code, out2, err = run_cli([*base, "--lora-targets", spelled, "--engine", "analytic"], capsys)
    assert json.loads(out)["trainable_params"] == json.loads(out2)["trainable_params"]
