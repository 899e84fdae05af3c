# Every target that needs Python creates .venv and installs on a fresh machine.
# torch is pinned first: these machines hold a CPU build of torch==2.13.0 on local disk,
# an unpinned torch would pull a multi-GB CUDA build.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.phasemech-installed
TORCH_PIN := torch==2.13.0
FULL ?= 0

.PHONY: test figures lint bench sweep clean

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q $(TORCH_PIN)
	$(PY) -m pip install -q -e '.[dev]'
	touch $(STAMP)

test: $(STAMP)
	$(PY) -m pytest -q

figures: $(STAMP)
	$(PY) analyses/head_phase_attention.py --out figures --runs runs $(if $(filter 1,$(FULL)),--full,)

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

bench: $(STAMP)
	$(PY) bench/attention_scaling.py
	$(PY) bench/patching.py

sweep: $(STAMP)
	$(PY) analyses/phase_sweep.py --runs runs $(if $(filter 1,$(FULL)),--profile full,)

clean:
	rm -rf figures/*.html figures/*.png runs bench/results
