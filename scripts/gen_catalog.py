"""Regenerate ``catalog/derived.json``: exact parameter tables of the catalog models.

Each catalog config is built with transformers on the meta device for the tasks it serves, so
``plan`` and ``estimate --engine analytic`` need no model build.
tests/catalog/test_catalog.py checks that regenerating gives the same data.

    python scripts/gen_catalog.py            # rewrite the file
    python scripts/gen_catalog.py --check    # exit 1 if the file is stale
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from batchfit.models import ENCODER_DECODER_TYPES, ENCODER_TYPES, _meta, catalog
from batchfit.models._arch import VISION_TYPES

OUT = Path(__file__).resolve().parents[1] / "src" / "batchfit" / "catalog" / "derived.json"


def tasks_for(model_type: str) -> tuple[str, ...]:
    if model_type in VISION_TYPES:
        return ("image-classification",)
    if model_type in ENCODER_DECODER_TYPES:
        return ("seq2seq",)
    if model_type in ENCODER_TYPES:
        return ("masked-lm", "classification")
    return ("causal-lm", "classification")


def derive(names: list[str] | None = None) -> dict[str, Any]:
    import transformers

    models: dict[str, Any] = {}
    for entry in catalog.load("models")["models"]:
        if names and entry["name"] not in names:
            continue
        cfg = entry["config"]
        models[entry["name"]] = {
            task: _meta.param_table(_meta.build_on_meta(cfg, task))
            for task in tasks_for(cfg["model_type"])
        }
    return {"transformers": transformers.__version__, "models": models}


def render(data: dict[str, Any]) -> str:
    # One parameter row per line keeps the file diffable.
    lines = ["{", f'  "transformers": {json.dumps(data["transformers"])},', '  "models": {']
    model_items = list(data["models"].items())
    for i, (name, tasks) in enumerate(model_items):
        lines.append(f"    {json.dumps(name)}: {{")
        task_items = list(tasks.items())
        for j, (task, rows) in enumerate(task_items):
            lines.append(f"      {json.dumps(task)}: [")
            lines += [
                f"        {json.dumps(r)}{',' if k < len(rows) - 1 else ''}"
                for k, r in enumerate(rows)
            ]
            lines.append(f"      ]{',' if j < len(task_items) - 1 else ''}")
        lines.append(f"    }}{',' if i < len(model_items) - 1 else ''}")
    lines += ["  }", "}", ""]
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="fail if derived.json is stale")
    args = parser.parse_args()
    text = render(derive())
    if args.check:
        # the models, not the version line: a transformers release that derives the same
        # numbers leaves the table current
        stale = (
            not OUT.exists() or json.loads(OUT.read_text())["models"] != json.loads(text)["models"]
        )
        print("derived.json is stale: run make catalog" if stale else "derived.json is current")
        return int(stale)
    OUT.write_text(text)
    print(f"wrote {OUT}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
