# Two entry points, each doing its own set-up on a fresh machine:
#   make demo   the seed's example and a speed table (GPU if present, else CPU), in a lean
#               environment of its own: bsmm alone, plus on a GPU machine the CUDA extra that
#               matches the driver and PyTorch (the demo's training step)
#   make test   the whole test suite (CPU), the documentation build, the wheel check on Python
#               3.11 and 3.12, the kernel compile checks (tools/ci/test.sh)
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
DEMO_VENV := .venv-demo
DEMO_STAMP := $(DEMO_VENV)/.installed

.PHONY: demo test bench docs wheel-check clean

# pyproject.toml's dependency groups (PEP 735) need pip 25.1 or newer.
$(STAMP): setup.cfg pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade 'pip>=25.1'
	$(PY) -m pip install --quiet -e . --group ci
	touch $(STAMP)

# The driver's CUDA version (nvidia-smi's header) picks the extra: CUDA 13 wheels need a driver
# that runs CUDA 13; older drivers get the CUDA 12 wheels.
$(DEMO_STAMP): setup.cfg pyproject.toml
	$(PYTHON) -m venv $(DEMO_VENV)
	$(DEMO_VENV)/bin/python -m pip install --quiet --upgrade pip
	@extra=""; \
	if command -v nvidia-smi >/dev/null 2>&1 && cuda=$$(nvidia-smi | sed -n 's/.*CUDA Version: *\([0-9]*\).*/\1/p' | head -n 1) && [ -n "$$cuda" ]; then \
	  if [ "$$cuda" -ge 13 ]; then extra="[cuda13,torch]"; else extra="[cuda12,torch]"; fi; \
	fi; \
	echo "installing bsmm$$extra into $(DEMO_VENV)"; \
	$(DEMO_VENV)/bin/python -m pip install --quiet -e ".$$extra"
	touch $(DEMO_STAMP)

demo: $(DEMO_STAMP)
	$(DEMO_VENV)/bin/python -m bsmm demo

test: $(STAMP)
	PYTHON=$(PY) bash tools/ci/test.sh

bench: $(STAMP)
	$(PY) -m bsmm bench -v

wheel-check: $(STAMP)
	PYTHON=$(PY) bash tools/ci/check_wheel.sh

docs: $(STAMP)
	PYTHON=$(PY) bash tools/ci/build_docs.sh

clean:
	rm -rf $(VENV) $(DEMO_VENV) build dist *.egg-info
