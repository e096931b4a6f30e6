"""``python -m moe_offload.cli``: the ``moe-offload`` command."""

import sys

from .entry import main

sys.exit(main())
