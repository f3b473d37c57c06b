# `make demo` and `make test` each build .venv when needed, then run, offline.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
export HF_HUB_OFFLINE := 1
export TRANSFORMERS_OFFLINE := 1

.PHONY: venv demo test lint bench bench-docs catalog docs clean

venv: $(STAMP)

# torch==2.13.0 first when none is importable: a bare `torch` would pull a multi-GB CUDA build.
$(STAMP): pyproject.toml constraints.txt
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -c "import torch" 2>/dev/null || $(BIN)/python -m pip install -q torch==2.13.0
	# the rest through uv (seconds where pip takes a minute); pip where uv cannot be installed.
	# DeepSpeed only parses exported configs in the tests (CPU build, no ops compiled).
	$(BIN)/python -m pip install -q uv || true
	if test -x $(BIN)/uv; then i="$(BIN)/uv pip install -q --python $(BIN)/python"; \
	else i="$(BIN)/python -m pip install -q"; fi; \
	$$i -c constraints.txt -e ".[hf,lightning,plot,dev]" && \
	{ DS_BUILD_OPS=0 $$i -c constraints.txt --no-build-isolation "deepspeed>=0.14" \
	|| echo "deepspeed did not install: its export tests will be skipped"; }
	touch $(STAMP)

demo: venv
	$(BIN)/python scripts/demo.py

test: venv
	$(BIN)/python -m pytest

lint: venv
	$(BIN)/ruff check src tests benchmarks scripts examples
	$(BIN)/ruff format --check src tests benchmarks scripts examples
	$(BIN)/mypy
	$(BIN)/lint-imports

bench: venv
	$(BIN)/python benchmarks/latency.py

# docs/benchmarks.md's tables from benchmarks/data/*.json (runs no benchmark; twice changes nothing)
bench-docs: venv
	$(BIN)/python benchmarks/report.py

catalog: venv
	$(BIN)/python scripts/gen_catalog.py

# the README's pictures (docs/img/*.png): a traced step, a monitored CPU run, a CPU probe (minutes)
docs: venv
	$(BIN)/python scripts/make_docs.py

clean:
	rm -rf $(VENV) build src/*.egg-info .pytest_cache .mypy_cache .ruff_cache
