"""User-facing errors: one clear paragraph, exit code != 0, no traceback.

Every error a user can cause by their input (a recipe, a CLI override, a file) is raised
as a `UserError`. `run_cli` turns it into a message on stderr and an exit code; anything
else is a bug and keeps its traceback. `HYDRA_FULL_ERROR=1` or `debug=true` shows the
traceback of user errors too.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from megatron_bridge.parallel.rules.base import Violation

EXIT_USER_ERROR = 2


class UserError(Exception):
    """An error caused by the user's input. `str()` is the whole message shown to them."""

    exit_code = EXIT_USER_ERROR


class LayoutError(UserError):
    """The parallel layout breaks one or more rules; carries every violation at once."""

    def __init__(self, violations: Sequence[Violation], header: str = "") -> None:
        self.violations = list(violations)
        lines = [header or f"The parallel layout breaks {len(self.violations)} rule(s):"]
        lines += [f"  - {v}" for v in self.violations]
        super().__init__("\n".join(lines))


class HelpRequested(Exception):
    """`-h`/`--help` on a command line (config.compose.parse_command): `run_cli` prints the
    text it carries, the command's docstring, and exits 0."""

    def __init__(self, text: str) -> None:
        super().__init__(text)
        self.text = text


def _debug_requested(argv: Sequence[str]) -> bool:
    if os.environ.get("HYDRA_FULL_ERROR") == "1":
        return True
    return any(a in ("debug=true", "debug=True", "+debug=true") for a in argv)


def run_cli(fn: Callable[[Sequence[str]], int], argv: Sequence[str]) -> int:
    """Run `fn(argv)`; map `UserError` to a clean message and its exit code, `HelpRequested`
    to its text and exit 0."""
    try:
        return int(fn(argv) or 0)
    except HelpRequested as e:
        print(e.text)
        return 0
    except UserError as e:
        if _debug_requested(argv):
            raise
        # one write, newline included: a launcher SIGTERMs the other ranks as soon as one exits,
        # and print()'s separate write of the end would leave a killed rank's paragraph unended
        sys.stderr.write(f"error: {e}\n")
        sys.stderr.flush()
        return e.exit_code
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
