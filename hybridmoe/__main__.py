"""`python -m hybridmoe <command>`: the same entry point as the `hybridmoe` script."""

from hybridmoe.cli import entry

entry()
