import sys

from psyche.cli.server.main import main

sys.exit(main())
