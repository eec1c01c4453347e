# fp8kv: two commands on a fresh machine.
#   make report   execute every notebook headless and render it under reports/<gpu>/ (CPU fallback: smoke sizes)
#   make test     run the test suite (Triton kernels under the interpreter where there is no GPU)
# Both create .venv and install fp8kv into it first. Set PYTHON=... to use an existing environment
# (e.g. the conda env from environment.yml) instead: make test PYTHON=python

VENV ?= .venv
PYTHON ?= $(VENV)/bin/python
# Test processes (pytest-xdist, where installed): one per core by default; TEST_WORKERS=0 runs in this process alone.
TEST_WORKERS ?= auto
STAMP := $(VENV)/.installed

.PHONY: report announce-report test install clean-venv

report: announce-report $(if $(filter $(VENV)/bin/python,$(PYTHON)),$(STAMP))
	@echo "[report] running every notebook headless into reports/<gpu>/ (progress per notebook below)"
	$(PYTHON) -m fp8kv.notebooks run

announce-report:
	@echo "[report] $(if $(wildcard $(STAMP)),environment $(VENV) is ready,setting up $(VENV) first (a minute or more; each step is printed))"

test: $(if $(filter $(VENV)/bin/python,$(PYTHON)),$(STAMP))
	$(PYTHON) -m pytest $$($(PYTHON) -c "import xdist" 2>/dev/null && echo "-n $(TEST_WORKERS) --dist loadgroup")

install: $(STAMP)

$(STAMP): pyproject.toml scripts/install.sh
	bash scripts/install.sh $(VENV)
	touch $(STAMP)

clean-venv:
	rm -rf $(VENV)
