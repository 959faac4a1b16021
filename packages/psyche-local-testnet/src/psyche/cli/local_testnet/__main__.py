import sys

from psyche.cli.local_testnet.main import main

sys.exit(main())
