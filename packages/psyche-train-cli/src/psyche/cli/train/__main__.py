"""`python -m psyche.cli.train` runs `psyche-train`."""

import sys

from psyche.cli.train.main import main

sys.exit(main())
