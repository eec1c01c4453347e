"""``python -m fp8kv.bench``: the same command as ``fp8kv bench``."""

import sys

from .cli import main

sys.exit(main())
