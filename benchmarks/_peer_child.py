"""One peer finder, or one fresh-process check, under an OS data limit (search_vs_peers.py).

    python benchmarks/_peer_child.py '{"mode": "truth", "model": CONFIG, "seq": 256,
                                        "budget": BYTES, "n": 9}'

Modes: ``truth`` (a step at micro-batch 1 so the optimizer state exists, then one step at
``n``), ``verify`` (``steps`` steps at ``n`` from the start), ``lightning`` (``Tuner.
scale_batch_size`` with ``lightning_mode``, defaults otherwise), ``accelerate``
(``find_executable_batch_size(starting_batch_size=128)`` around 3 training steps).

Every mode does what batchfit's probe child does before its limit: imports, then one warm-up step
of a 1-layer copy at a tiny size (kernels, thread pools). Then RLIMIT_DATA is set to the data
segment the process holds plus the budget, and only then is the model built. The environment
(``MALLOC_MMAP_THRESHOLD_`` or glibc's defaults) is the parent's choice. Progress lines and one
last result line are printed as JSON.
"""

from __future__ import annotations

import json
import resource
import shutil
import sys
import tempfile
from typing import Any

SAMPLES = 1_000_000  # Lightning's dataset length: never the limit on the batch size


def _emit(message: dict[str, Any]) -> None:
    print(json.dumps(message), flush=True)


def _vmdata() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmData:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("VmData not in /proc/self/status")


def main() -> None:
    spec = json.loads(sys.argv[1])
    mode = spec["mode"]
    import torch

    from batchfit._oom import is_oom
    from batchfit.memory.trace import dry_run as trace
    from batchfit.memory.trace import hf as _hf_trace
    from batchfit.models import resolve_model
    from batchfit.search.probe import warm_up
    from batchfit.spec import TrainingSetup

    if mode == "lightning":
        import lightning as L
        from lightning.pytorch.tuner import Tuner
        from lightning.pytorch.tuner import batch_size_scaling as scaling
    elif mode == "accelerate":
        from accelerate.utils import find_executable_batch_size

    info = resolve_model(spec["model"], None)
    setup = TrainingSetup().resolved(device="cpu", bf16_supported=True)
    seq = spec["seq"]
    warm_up(info, setup)  # before the limit, the same as batchfit's probe child

    trials: list[list[Any]] = []  # [size, steps completed, out of memory]

    def record(n: int, done: bool) -> None:
        if not trials or trials[-1][0] != n or trials[-1][2]:
            trials.append([n, 0, False])
        if done:
            trials[-1][1] += 1
        else:
            trials[-1][2] = True

    def train_step(model: Any, opt: Any, n: int) -> None:
        # batchfit's probe step: the outputs (logits) stay alive through backward, as in
        # ``out = model(**batch); out.loss.backward()``
        opt.zero_grad(set_to_none=True)
        batch = _hf_trace.batch_fn(info, n, seq)()
        out = model(**batch)
        out.loss.backward()
        del out
        opt.step()

    if mode == "lightning":
        root = tempfile.mkdtemp(prefix="sbp-lightning-")
        trainer = L.Trainer(
            accelerator="cpu",
            devices=1,
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            max_steps=1_000_000,
            default_root_dir=root,
        )

    old = resource.getrlimit(resource.RLIMIT_DATA)
    resource.setrlimit(resource.RLIMIT_DATA, (_vmdata() + spec["budget"], old[1]))

    if mode in ("truth", "verify"):
        with trace.quiet():
            parts = _hf_trace.step_parts(info, setup, micro=1, seq=seq, emulate_cuda=False)
        model, opt = parts.model, parts.optimizer
        plan = [1, spec["n"]] if mode == "truth" else [spec["n"]] * spec["steps"]
        error = None
        for n in plan:
            try:
                train_step(model, opt, n)
            except Exception as e:
                if not is_oom(e):
                    raise
                error = str(e).strip().splitlines()[0][:160]
                record(n, False)
                break
            record(n, True)
        _emit({"result": {"ok": error is None, "error": error, "trials": trials}})
        return

    if mode == "accelerate":
        with trace.quiet():
            parts = _hf_trace.step_parts(info, setup, micro=1, seq=seq, emulate_cuda=False)
        model, opt = parts.model, parts.optimizer
        counts = {"calls": 0, "attempts": 0}

        @find_executable_batch_size(starting_batch_size=128)
        def train(batch_size: int) -> int:
            counts["attempts"] += 1
            _emit({"attempt": batch_size})
            for _ in range(3):
                counts["calls"] += 1
                try:
                    train_step(model, opt, batch_size)
                except Exception:
                    record(batch_size, False)
                    raise
                record(batch_size, True)
            return batch_size

        with trace.quiet():
            size = train()
        _emit(
            {
                "result": {
                    "size": size,
                    "steps": counts["calls"],
                    "ooms": counts["attempts"] - 1,
                    "trials": trials,
                }
            }
        )
        return

    # Lightning: the same HF model in a LightningModule; a new AdamW per fit, as users write it.
    class Tokens(torch.utils.data.Dataset):  # type: ignore[type-arg]
        def __len__(self) -> int:
            return SAMPLES

        def __getitem__(self, i: int) -> dict[str, Any]:
            vocab = info.arch.vocab_size
            return {
                "input_ids": torch.randint(0, vocab, (seq,)),
                "labels": torch.randint(0, vocab, (seq,)),
            }

    calls = {"n": 0}

    class LitLM(L.LightningModule):
        def __init__(self, net: torch.nn.Module) -> None:
            super().__init__()
            self.net = net
            self.batch_size = 2
            self.out: Any = None

        def training_step(self, batch: dict[str, Any], _idx: int) -> Any:
            calls["n"] += 1
            n = int(batch["input_ids"].shape[0])
            if not trials or trials[-1][0] != n or trials[-1][2]:
                trials.append([n, 0, False])  # completed in on_train_batch_end
            self.out = self.net(**batch)  # alive through backward, as in the other finders
            return self.out.loss

        def on_after_backward(self) -> None:
            self.out = None

        def on_train_batch_end(self, *_: Any) -> None:
            trials[-1][1] += 1

        def configure_optimizers(self) -> Any:
            return torch.optim.AdamW(self.net.parameters(), lr=1e-4, weight_decay=0.01)

        def train_dataloader(self) -> Any:
            return torch.utils.data.DataLoader(Tokens(), batch_size=self.batch_size, num_workers=0)

    ooms = {"n": 0}
    is_oom_error = scaling.is_oom_error

    def counting(exc: BaseException) -> bool:
        hit = bool(is_oom_error(exc))
        if hit:
            ooms["n"] += 1
            if trials:
                trials[-1][2] = True
        return hit

    scaling.is_oom_error = counting  # type: ignore[assignment]
    with trace.quiet():
        parts = _hf_trace.step_parts(info, setup, micro=1, seq=seq, emulate_cuda=False)
        lit = LitLM(parts.model)
        del parts
        size = Tuner(trainer).scale_batch_size(lit, mode=spec["lightning_mode"])
    shutil.rmtree(root, ignore_errors=True)
    _emit({"result": {"size": size, "steps": calls["n"], "ooms": ooms["n"], "trials": trials}})


if __name__ == "__main__":
    main()
