"""``python -m chunkstore.cli``."""

import sys

from chunkstore.cli import main

sys.exit(main())
