"""`python -m hybridmoe <command>`: the same entry point as the `hybridmoe` script."""

import sys

from hybridmoe.cli import main

sys.exit(main())
