"""The command-line tools of a GPU machine run without the notebook extras: the bench, the step model and the
analyses import no plotly, ipywidgets or papermill until a figure or a notebook is asked for."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BLOCK = """
import importlib.abc, sys
class Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name.split('.')[0] in ('plotly', 'ipywidgets', 'papermill', 'nbconvert'):
            raise ModuleNotFoundError(f'{name} is blocked')
sys.meta_path.insert(0, Block())
import importlib
importlib.import_module(sys.argv[1])
"""


@pytest.mark.parametrize("module", ["fp8kv", "fp8kv.bench.cli", "fp8kv.step.cli", "fp8kv.analysis",
                                    "fp8kv.ops.quant_decode", "fp8kv.ops.attend"])
def test_tools_import_without_the_notebook_extras(module):
    env = dict(os.environ, PYTHONPATH=str(ROOT), TRITON_INTERPRET="1")
    done = subprocess.run([sys.executable, "-c", BLOCK, module], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]


def test_the_block_catches_an_import_of_plotly():
    env = dict(os.environ, PYTHONPATH=str(ROOT), TRITON_INTERPRET="1")
    done = subprocess.run([sys.executable, "-c", BLOCK, "fp8kv.viz"], env=env, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode != 0 and "plotly is blocked" in done.stderr
