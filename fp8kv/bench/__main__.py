"""``python -m fp8kv.bench``: the same command as ``fp8kv bench``."""

import sys

from .cli import main, restart_interpreted

restart_interpreted("fp8kv.bench")
sys.exit(main())
