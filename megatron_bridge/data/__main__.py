"""`python -m megatron_bridge.data ARGS` is `mbr data ARGS`."""

import sys

from megatron_bridge.errors import run_cli


def _main(argv):
    from megatron_bridge.commands.data import main

    return main(argv)


if __name__ == "__main__":
    sys.exit(run_cli(_main, sys.argv[1:]))
