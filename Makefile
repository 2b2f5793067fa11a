# mt: every target that runs the pipeline passes ARGS through unchanged, e.g.
#   make train ARGS="experiment=wmt14_en_de_base train.max_tokens=8192 model.dropout=0.3"
# `make help` lists the targets.

VENV ?= .venv
PYTHON ?= python3
TORCH ?= torch==2.13.0
WHEELS ?=
GPUS ?= 1
ARGS ?=

ifeq ($(VENV),)
PY := $(PYTHON)
else
PY := $(VENV)/bin/python
endif
PIP_OPTS := $(if $(WHEELS),--no-index --find-links $(WHEELS),)
ifeq ($(GPUS),1)
LAUNCH := $(PY) -m mt
else
LAUNCH := $(PY) -m torch.distributed.run --standalone --nproc_per_node=$(GPUS) -m mt
endif
STAMP := $(if $(VENV),$(VENV),.)/.mt-installed

.PHONY: help install test lint smoke train prepare evaluate bench clean

help:  ## list the targets
	@grep -E '^[a-z]+:.*## ' $(MAKEFILE_LIST) | awk -F':.*## ' '{printf "  make %-9s %s\n", $$1, $$2}'
	@echo "  Variables: ARGS=\"key=value ...\" (Hydra overrides), GPUS=N (torchrun), VENV= (use PYTHON"
	@echo "  as it is), WHEELS=DIR (install offline from downloaded wheels), TORCH=torch==X"

install: $(STAMP)  ## create .venv if missing and install mt into it (torch pinned by TORCH)

$(STAMP): pyproject.toml
	@if [ -n "$(VENV)" ] && [ ! -x "$(PY)" ]; then $(PYTHON) -m venv $(VENV); fi
	@$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install $(PIP_OPTS) "$(TORCH)"
	$(PY) -m pip install $(PIP_OPTS) -e ".[all,dev]"
	@touch $@

test: install  ## lint (ruff) and the whole test suite
	$(PY) -m ruff check mt tests scripts
	$(PY) -m pytest -q --durations=10 $(ARGS)

lint: install  ## ruff alone
	$(PY) -m ruff check mt tests scripts

prepare: install  ## stages 1-2: data and SentencePiece (cached)
	$(PY) -m mt prepare $(ARGS)

train: install  ## the whole pipeline: prepare -> train -> evaluate (test BLEU, run directory)
	$(PY) -m mt prepare $(ARGS)
	$(LAUNCH) train $(ARGS)
	$(PY) -m mt evaluate $(ARGS)

smoke: install  ## the whole pipeline on a tiny model and a slice of Multi30k (< 2 min)
	$(MAKE) --no-print-directory train ARGS="experiment=smoke $(ARGS)"

evaluate: install  ## decode the test split of a run and score it with sacreBLEU
	$(PY) -m mt evaluate $(ARGS)

bench: install  ## speed benchmarks (training, data loader, decoding); ARGS="train --help"
	$(PY) scripts/bench.py $(ARGS)

clean:  ## remove caches and build outputs (not runs/ nor .venv)
	rm -rf .cache .pytest_cache .ruff_cache dist build
