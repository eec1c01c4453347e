"""The README's published results, generated from the results files they cite.

``python -m fp8kv.published readme`` rewrites every table and measured number of README.md's Results
section from the files under ``results/`` and ``reports/`` that the README names beside them;
``--check`` fails with a diff when a hand edit or a changed file makes the two differ, and names a
cited file that is missing. Modules: :mod:`.sources` (readers of the cited files), :mod:`.textfiles`
(the figures quoted from profile summaries and console logs), :mod:`.probes` (a probe's points under
two rules), :mod:`.fmt` (how a number and a range print), one module per README section or its
probes (the values it computes), :mod:`.render` (the README's markers), :mod:`.readme` (all of it
together), :mod:`.cli`. A number in the Results section outside the markers is a target, a threshold
or a size, never a measurement (tests/test_published_readme.py scans for one).
"""

from .readme import check, compute, generate
from .sources import MissingSourceError, Sources

__all__ = ["check", "compute", "generate", "MissingSourceError", "Sources"]
