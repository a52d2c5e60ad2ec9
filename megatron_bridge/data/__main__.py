"""`python -m megatron_bridge.data ARGS` is `mbr data ARGS`."""

import sys

from megatron_bridge.commands.data import main
from megatron_bridge.errors import run_cli

if __name__ == "__main__":
    sys.exit(run_cli(main, sys.argv[1:]))
