"""`mbr recipes`: every recipe and group option on the config search path, and where it comes from.

    mbr recipes                          # built-ins and $MBR_CONFIG_PATH's dirs
    mbr recipes --config-dir ~/my-configs
    mbr recipes recipe=path/to/mine.yaml       # adds the dir that recipe file is in

User dirs come first and win (megatron_bridge/config/search.py); an entry that hides one
of the same name further down the path says so, so an override is never silent. It composes
no recipe and has no fields of its own: it takes only the search path (`--config-dir`,
`recipe=`), through the same parser as every command.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar

from megatron_bridge.config import search
from megatron_bridge.config.compose import CommandArgs, parse_command


@dataclass
class RecipesArgs(CommandArgs):
    """`mbr recipes` has no fields: only the config search path."""

    CLI_SEARCH_PATH: ClassVar[bool] = True
    CLI_USAGE: ClassVar[str] = "usage: mbr recipes [--config-dir DIR ...] [recipe=PATH.yaml]"


def render(sources: Sequence[search.Source]) -> str:
    def where(s: search.Source, path) -> str:
        return search.BUILTIN if s.origin == search.BUILTIN else f"{path}  ({s.origin})"

    lines = ["search path (first found wins):"]
    lines += [f"  {i + 1}. {where(s, s.root)}" for i, s in enumerate(sources)]
    for section, entries in search.catalogue(sources).items():
        if not entries:
            continue
        lines.append(f"{section}:")
        width = max(len(e.name) for e in entries)
        for e in entries:
            over = f"  overrides {', '.join(where(s, s.root) for s in e.shadows)}" if e.shadows else ""
            lines.append(f"  {e.name:<{width}}  {where(e.source, e.path)}{over}")
    return "\n".join(lines)


def main(argv: Sequence[str]) -> int:
    _, args = parse_command(argv, RecipesArgs, doc=__doc__)
    print(render(args.sources()))
    return 0
