"""``python -m fp8kv ...``: the same as the ``fp8kv`` console script (:mod:`fp8kv.cli`)."""

import sys

from .cli import main

sys.exit(main())
