"""`python -m psyche.cli.client` runs `psyche-client`."""

import sys

from psyche.cli.client.main import main

sys.exit(main())
