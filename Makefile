# fp8kv: two commands on a fresh machine.
#   make report   execute every notebook headless and render it under reports/<gpu>/ (CPU fallback: smoke sizes)
#   make test     run the test suite (Triton kernels under the interpreter where there is no GPU)
# Both create .venv and install fp8kv into it first. Set PYTHON=... to use an existing environment
# (e.g. the conda env from environment.yml) instead: make test PYTHON=python

VENV ?= .venv
PYTHON ?= $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: report test install clean-venv

report: $(if $(filter $(VENV)/bin/python,$(PYTHON)),$(STAMP))
	$(PYTHON) -m fp8kv.notebooks run

test: $(if $(filter $(VENV)/bin/python,$(PYTHON)),$(STAMP))
	$(PYTHON) -m pytest

install: $(STAMP)

$(STAMP): pyproject.toml scripts/install.sh
	bash scripts/install.sh $(VENV)
	touch $(STAMP)

clean-venv:
	rm -rf $(VENV)
