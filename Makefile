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

.PHONY: help install test lint smoke train prepare evaluate bench clean serve export browser gpu-check \
	backtranslation distillation

help:  ## list the targets
	@grep -E '^[a-z-]+:.*## ' $(MAKEFILE_LIST) | awk -F':.*## ' '{printf "  make %-10s %s\n", $$1, $$2}'
	@echo "  Variables: ARGS=\"key=value ...\" (Hydra overrides), GPUS=N (torchrun), VENV= (use PYTHON"
	@echo "  as it is), WHEELS=DIR (install offline from downloaded wheels), TORCH=torch==X"

install: $(STAMP) browser  ## create .venv if missing and install mt into it (torch pinned by TORCH)

# The page test of mt-serve drives a headless Chromium: installed from Debian where apt works as
# root, otherwise that one test skips with its reason.
browser:
	@command -v chromium >/dev/null 2>&1 || command -v chromium-browser >/dev/null 2>&1 || \
	  { if command -v apt-get >/dev/null 2>&1 && [ "$$(id -u)" = 0 ]; then \
	      echo "installing Debian's chromium (for the web page test)"; \
	      DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends chromium \
	        >/dev/null 2>&1 || { apt-get update -qq >/dev/null 2>&1 && \
	      DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends chromium \
	        >/dev/null 2>&1; } || echo "chromium not installed: the page test will skip"; \
	  else echo "no chromium (apt-get install chromium): the page test will skip"; fi; }

$(STAMP): pyproject.toml
	@if [ -n "$(VENV)" ] && [ ! -x "$(PY)" ]; then $(PYTHON) -m venv $(VENV); fi
	@$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install $(PIP_OPTS) "$(TORCH)"
	$(PY) -m pip install $(PIP_OPTS) -e ".[all,dev]"
	@touch $@

# Test files in this many processes (pytest-xdist; a file's tests stay together, so its
# fixtures are made once); TEST_WORKERS=0 runs them in this process, one after the other.
TEST_WORKERS ?= 2

test: install  ## lint (ruff) and the whole test suite (TEST_WORKERS processes)
	$(PY) -m ruff check mt tests scripts
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile --durations=10 $(ARGS)

lint: install  ## ruff alone
	$(PY) -m ruff check mt tests scripts

prepare: install  ## stages 1-2: data and SentencePiece (cached)
	$(PY) -m mt prepare $(ARGS)

# A Hydra multirun (ARGS with -m): mt-train evaluates each trial in its own run directory as
# the trial ends (train.evaluate=true), and the sweep's summary.md names their test scores; a
# separate `mt-evaluate -m` would compose a sweep directory of its own and find no trial there.
# Each trial prepares its data on a cache miss (its data and tokenizer settings may be swept).
# The flag goes first: Hydra's parser takes no option after an override (make smoke adds one).
MULTIRUN := $(filter -m --multirun,$(ARGS))

train: install  ## the whole pipeline: prepare -> train -> evaluate (test BLEU, run directory)
ifeq ($(MULTIRUN),)
	$(PY) -m mt prepare $(ARGS)
	$(LAUNCH) train $(ARGS)
	$(PY) -m mt evaluate $(ARGS)
else
	$(LAUNCH) train $(MULTIRUN) $(filter-out -m --multirun,$(ARGS)) train.evaluate=true
endif

smoke: install  ## the whole pipeline on a tiny model and a slice of Multi30k (< 2 min)
	$(MAKE) --no-print-directory train ARGS="experiment=smoke $(ARGS)"

evaluate: install  ## decode the test split of a run and score it with sacreBLEU
	$(PY) -m mt evaluate $(ARGS)

bench: install  ## speed benchmarks (training, data loader, decoding); ARGS="train --help"
	$(PY) scripts/bench.py $(ARGS)

export: install  ## export a checkpoint: ARGS="checkpoint=PATH format=hf|ctranslate2 output=DIR"
	$(PY) -m mt export $(ARGS)

serve: install  ## translation server and web page: ARGS="checkpoint=PATH [host=127.0.0.1 port=8000]"
	$(PY) -m mt serve $(ARGS)

backtranslation: install  ## reverse model -> back-translated news -> forward model (ARGS="--help")
	$(PY) scripts/backtranslation.py $(ARGS)

distillation: install  ## teacher -> distilled corpus -> small students, a table (ARGS="--help")
	$(PY) scripts/distillation.py $(ARGS)

gpu-check:  ## on a GPU machine: GPU tests, benches, Multi30k, a profile -> gpu-check/summary.md
	$(PYTHON) scripts/gpu_check.py $(ARGS)

clean:  ## remove caches and build outputs (not runs/ nor .venv)
	rm -rf .cache .pytest_cache .ruff_cache dist build
