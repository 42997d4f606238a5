# Two entry points, each doing its own set-up on a fresh machine:
#   make demo   the seed's example and a speed table (GPU if present, else CPU)
#   make test   the whole test suite (CPU), kernel compile checks, the wheel check
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: demo test bench wheel-check clean

$(STAMP): setup.cfg pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[test,nvrtc,frameworks,notebooks]'
	touch $(STAMP)

demo: $(STAMP)
	$(PY) -m bsmm demo

test: $(STAMP)
	$(PY) -m pytest -q tests --doctest-modules bsmm
	PYTHON=$(PY) bash tools/ci/check_wheel.sh
	$(PY) tools/ci/compile_kernels.py --arch sm_80 --arch sm_90a --jobs 2

bench: $(STAMP)
	$(PY) -m bsmm bench -v

clean:
	rm -rf $(VENV) build dist *.egg-info
