"""``python -m fp8kv.published``: the README's results, regenerated from the files they cite."""

import sys

from .cli import main

sys.exit(main())
