"""batchfit.profile_memory: a measured block, split as an estimate is."""

from __future__ import annotations

import torch

import batchfit


def _mlp() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    net = torch.nn.Sequential(
        torch.nn.Linear(512, 2048), torch.nn.ReLU(), torch.nn.Linear(2048, 512)
    )
    return net, torch.optim.AdamW(net.parameters())


def test_a_training_step_is_split_into_the_estimates_components() -> None:
    net, opt = _mlp()
    params = sum(p.numel() * 4 for p in net.parameters())
    with batchfit.profile_memory(net, opt) as prof:
        for _ in range(2):  # the second step holds AdamW's state from the first
            loss = net(torch.randn(64, 512)).square().mean()
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
    r = prof.result
    assert r is not None
    assert r.components["weights"] == params
    # exp_avg and exp_avg_sq, and a 4-byte step counter per parameter tensor
    assert r.components["optimizer_state"] == 2 * params + 4 * len(list(net.parameters()))
    assert r.peak_bytes == sum(r.components.values())
    assert r.device == "cpu" and r.device_peak_bytes is not None and r.reserved_bytes is None
    assert "peak allocated" in r._repr_html_()


def test_the_decorator_keeps_the_last_profile() -> None:
    net, _ = _mlp()

    @batchfit.profile_memory(net)
    def forward() -> torch.Tensor:
        return net(torch.randn(128, 512))

    out = forward()
    assert out.shape == (128, 512)
    profile = forward.profile  # type: ignore[attr-defined]
    # the output (128 x 512 fp32) outlives the block: counted as activations at the peak
    assert profile.components["activations"] >= 128 * 512 * 4
    assert profile.components["gradients"] == 0
