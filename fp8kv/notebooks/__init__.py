"""Run the notebooks headless and publish them as a per-GPU report; the results-JSON helpers they use.

Command line (``python -m fp8kv.notebooks`` is the same as ``fp8kv notebooks``; ``run`` is the default)::

    python -m fp8kv.notebooks run [--smoke | --full] [--only NAME ...] [--timeout S] [--out reports]
                                  [--device auto] [--seed 0] [--notebooks notebooks] [--no-progress]
    python -m fp8kv.notebooks list

What a run does
---------------
1. Finds ``notebooks/*.ipynb`` (sorted by name, so ``00_...`` runs first); ``--only`` picks some.
2. Executes each with papermill (kernel ``python3``, a per-cell ``execution_timeout``), injecting the
   parameters ``SMOKE``, ``DEVICE``, ``OUT_DIR``, ``SEED`` and ``SHOW_WIDGETS=False`` (always False:
   displaying widgets under papermill can stall the run). The working directory is the notebook's
   folder, as in JupyterLab. Each notebook writes its numbers with :func:`save_results` to
   ``OUT_DIR/<name>.json``.
3. Renders every executed notebook to HTML (nbconvert), plotly figures included and viewable offline:
   the pages load plotly.js from one ``<out>/plotly-<version>.min.js`` above every GPU's folder instead of
   embedding the 4.6 MB library each (:func:`externalize_plotlyjs`); the executed ``.ipynb`` keeps every figure but
   not the library (:func:`strip_embedded_plotlyjs`).
4. Publishes ``<out>/<gpu-slug>/``: ``<name>.html``, ``<name>.ipynb`` (executed), ``<name>.json``
   and ``manifest.json`` (device, versions, mode, timestamps, and per
   notebook its status, duration and source hash; relative paths only). The pages load nothing
   from the network, and their parameters show ``OUT_DIR`` as the published folder.
5. Rebuilds ``<out>/index.html``: every GPU folder there on one page (also ``python -m fp8kv.notebooks index``).

Report folders
--------------
Everything is written into a hidden staging folder beside the target (``<out>/.<slug>.staging-*``)
and moved into place only at the end: the old ``<out>/<slug>`` is renamed aside, the staging folder
renamed to ``<out>/<slug>``, then the old one deleted. A reader never sees a half-written report, and
a run on one GPU never touches another GPU's folder. If the runner itself is interrupted or crashes,
the staging folder is deleted and the previous report stays as it was; SIGTERM and SIGINT stop the
run promptly (the running kernel is killed) and exit with status 128 + the signal number. The
notebooks that ran to the end are published; the one that was stopped keeps its previous page, and its
executed cells so far go to ``<out>/.interrupted/<slug>/<name>.ipynb`` (never a page), with one line on
stderr naming the cell it was stopped in, how long it had run and the slowest finished cells
(:mod:`.interrupted`).

With ``--only``, the other notebooks' files and manifest entries are carried over from the previous
report, so rerunning one notebook does not drop the others.

Failures
--------
A notebook that raises, exceeds the per-cell timeout, or finishes without writing its
``<name>.json`` is marked ``"failed"`` in the manifest (with the error), and the remaining notebooks
still run. The report is published all the same, including the failing notebook's executed
``.ipynb`` and ``.html`` (papermill marks the failing cell), because that is what one needs to
inspect; the previous report of that GPU remains in version control. The command then lists the
failed notebooks and exits with status 1.

Defaults
--------
Mode: ``--full`` when ``DEVICE`` is a CUDA device (``auto`` on a GPU machine), else ``--smoke``
(small sizes, a minute or two on a CPU).
Per-cell timeout: ``DEFAULT_TIMEOUT_S[mode]``. When ``DEVICE`` is not a CUDA device the kernels get
``TRITON_INTERPRET=1`` (unless it is set already), so Triton kernels run in the interpreter.
"""


from __future__ import annotations

# Results IO lives in fp8kv.results; notebooks import it from here too.
from ..results import collect_results, load_results, save_results, to_jsonable
from .cli import add_actions, add_run_arguments, main, run_action, run_from_args
from .index import build_index, gpu_summary
from .pages import (
    INDEX,
    MANIFEST,
    discover_notebooks,
    drop_network_loads,
    externalize_plotlyjs,
    notebook_hash,
    render_html,
    render_report,
    strip_embedded_plotlyjs,
)
from .parameters import PARAMETER_NAMES
from .runner import DEFAULT_TIMEOUT_S, KERNEL_NAME, RunInterrupted, run_notebooks
from .setup import MachineSetup, machine_defaults, setup_notebook

__all__ = [
    "PARAMETER_NAMES",
    "DEFAULT_TIMEOUT_S",
    "save_results",
    "load_results",
    "collect_results",
    "to_jsonable",
    "discover_notebooks",
    "run_notebooks",
    "render_html",
    "render_report",
    "strip_embedded_plotlyjs",
    "externalize_plotlyjs",
    "add_run_arguments",
    "add_actions",
    "run_action",
    "run_from_args",
    "main",
    "setup_notebook",
    "machine_defaults",
    "MachineSetup",
    "notebook_hash",
    "drop_network_loads",
    "build_index",
    "gpu_summary",
    "RunInterrupted",
    "KERNEL_NAME",
    "MANIFEST",
    "INDEX",
]
