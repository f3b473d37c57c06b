"""Regenerate the README's pictures under docs/img/ (``make docs``), with the CLI a user runs.

- ``estimate-timeline.png``: ``batchfit estimate gpt2 ... --timeline`` (a dry run, no GPU);
- ``monitor.png``: ``batchfit monitor --plot`` around ``examples/train_tiny_gpt2.py`` (CPU);
- ``probe.png``: ``batchfit probe gpt2 --device cpu ... --plot`` (real CPU steps under a budget).

Each picture is written to a temporary folder first and moved into docs/img/ only when its
command succeeded, so a failed run leaves the committed picture as it was. A picture above
``MAX_BYTES`` fails the run: the README's pictures stay small in the repository.

    python scripts/make_docs.py [--only timeline|monitor|probe]
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
IMG = ROOT / "docs" / "img"
MAX_BYTES = 150_000
BATCHFIT = [sys.executable, "-m", "batchfit"]

# name -> the command's arguments; {out} is the picture's path
PICTURES: dict[str, list[str]] = {
    "estimate-timeline.png": [
        *BATCHFIT,
        "estimate",
        "gpt2",
        "--micro-batch",
        "4",
        "--seq-len",
        "512",
        "--gpu",
        "t4",
        "--timeline",
        "{out}",
    ],
    "monitor.png": [
        *BATCHFIT,
        "monitor",
        "--interval",
        "0.2",
        "--plot",
        "{out}",
        "--",
        sys.executable,
        str(ROOT / "examples" / "train_tiny_gpt2.py"),
        "--steps",
        "8",
    ],
    "probe.png": [
        *BATCHFIT,
        "probe",
        "gpt2",
        "--device",
        "cpu",
        "--seq-len",
        "128",
        "--memory-budget",
        "4GiB",
        "--steps-per-trial",
        "2",
        "--plot",
        "{out}",
    ],
}
SHORT = {"timeline": "estimate-timeline.png", "monitor": "monitor.png", "probe": "probe.png"}


def make(name: str, tmp: Path) -> Path:
    """Run the command that draws ``name`` into ``tmp``; its output goes to this terminal."""
    out = tmp / name
    command = [arg.replace("{out}", str(out)) for arg in PICTURES[name]]
    print(f"make_docs: {name}: {' '.join(command[2:])}", flush=True)
    start = time.perf_counter()
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    proc = subprocess.run(command, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, check=False)
    if proc.returncode != 0 or not out.exists():
        sys.exit(f"make_docs: {name}: the command failed (exit code {proc.returncode})")
    size = out.stat().st_size
    if size > MAX_BYTES:
        sys.exit(f"make_docs: {name} is {size:,} bytes, above {MAX_BYTES:,}: make it smaller")
    print(f"make_docs: {name}: {size:,} bytes in {time.perf_counter() - start:.0f} s")
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", choices=sorted(SHORT), action="append")
    args = parser.parse_args()
    names = [SHORT[s] for s in args.only] if args.only else list(PICTURES)
    IMG.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        for name in names:
            shutil.move(make(name, Path(tmp)), IMG / name)
    print(f"make_docs: {len(names)} picture(s) in {IMG.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
