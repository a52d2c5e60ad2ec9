"""`mbr`: one console script, one subcommand per tool.

Subcommands are looked up lazily in `COMMANDS` (module path, function) so that `mbr check`
imports neither torch nor megatron-core. Each command function takes the remaining argv
and reads it one way, `config.compose.parse_command(argv, schema, doc=__doc__)`: `key=value`
fields of the command's typed schema (composed with a recipe for the commands that run one)
plus `--flags`, the schema's declared other spellings, and `-h`/`--help` for its docstring.
It returns an exit code; user errors are raised as `UserError` and printed by `run_cli`
without a traceback.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Sequence

from megatron_bridge.errors import UserError, run_cli

COMMANDS: dict[str, tuple[str, str, str]] = {
    "check": ("megatron_bridge.commands.check", "main", "validate a recipe's layout and print its rank map"),
    "verify": (
        "megatron_bridge.commands.verify",
        "main",
        "HF model vs its megatron build under layouts: logits parity, round trip (--list: families)",
    ),
    "plan": (
        "megatron_bridge.commands.plan",
        "main",
        "choose the layout for a model on a cluster, with memory/comm/bubble",
    ),
    "data": (
        "megatron_bridge.commands.data",
        "main",
        "tokenize text into a megatron-core indexed dataset (demo=true: from the stdlib)",
    ),
    "launch": (
        "megatron_bridge.commands.launch",
        "main",
        "launch a recipe with torchrun, deepspeed, Slurm or Kubernetes (--dry-run prints)",
    ),
    "recipes": (
        "megatron_bridge.commands.recipes",
        "main",
        "list recipes and config-group options on the search path, with where each comes from",
    ),
    "init": ("megatron_bridge.commands.init", "main", "start a user config dir: a recipe and a cluster file to edit"),
    "check-ckpt": (
        "megatron_bridge.commands.check_ckpt",
        "main",
        "verify a training checkpoint against its manifest (sha256), naming any bad file",
    ),
    "convert": (
        "megatron_bridge.commands.convert",
        "main",
        "HF safetensors -> megatron checkpoint (torch_dist, or per-rank torch for parallel.*)",
    ),
    "export": (
        "megatron_bridge.commands.export",
        "main",
        "converted checkpoint -> HF safetensors + config + tokenizer (bit-exact)",
    ),
    "reshard": (
        "megatron_bridge.commands.reshard",
        "main",
        "converted checkpoint -> another TP/PP/EP layout or format, without HF",
    ),
}

USAGE = """usage: mbr <command> [recipe=NAME|PATH.yaml] [key=value ...] [--config-dir DIR ...] [--flags]

commands:
{commands}

Every key of every config group can be overridden: parallel.tp=4 parallel.pp=2 zero.stage=1
model=llama3_70b cluster=dgx_h100 cluster.nodes=8. `--cfg job` prints the resolved config.
Your own recipes and group options: `--config-dir DIR` or $MBR_CONFIG_PATH (`mbr init DIR`).
`mbr <command> --help` shows a command's own fields and examples.
"""


def usage() -> str:
    cmds = "\n".join(f"  {name:<10} {help_}" for name, (_, _, help_) in COMMANDS.items())
    return USAGE.format(commands=cmds)


def dispatch(argv: Sequence[str]) -> int:
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(usage())
        return 0
    name, rest = argv[0], list(argv[1:])
    if name not in COMMANDS:
        raise UserError(f"unknown command {name!r}; commands are: {', '.join(COMMANDS)}. See `mbr --help`.")
    module, func, _ = COMMANDS[name]
    return getattr(importlib.import_module(module), func)(rest)


def main(argv: Sequence[str] | None = None) -> int:
    code = run_cli(dispatch, list(sys.argv[1:] if argv is None else argv))
    sys.exit(code) if argv is None else None
    return code


if __name__ == "__main__":
    main()
