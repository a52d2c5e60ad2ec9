"""The bad-input catalogue (catalogue.py) through pytest: one test per invalid input.

All cases run once, in parallel, in a session fixture (subprocess cases on a few threads, the
rest in two batch interpreters); each test then checks its own case's result, so a failure
names the input. The table (input, expected rule, got, pass) is printed in pytest's terminal
summary. The torchrun cases carry the `dist` mark (deselected by `-m "not dist"`).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

try:  # pytest's default (prepend) import mode puts this directory on sys.path
    import catalogue as cat
except ImportError:  # pragma: no cover
    from tests.reliability import catalogue as cat

CASES = cat.all_cases()
TEST = "test_bad_input_is_rejected_cleanly"


@pytest.fixture(scope="session")
def catalogue(request, tmp_path_factory):
    wanted = {
        item.callspec.params["case"].id for item in request.session.items if getattr(item, "originalname", "") == TEST
    }
    cases = [c for c in CASES if c.id in wanted]
    root = tmp_path_factory.mktemp("catalogue")
    fx = cat.build_fixtures(root / "fx")
    before = cat.snapshot(fx)
    work = root / "work"
    work.mkdir()
    results = cat.run_all(cases, fx, work)
    request.config._mbr_catalogue = results
    return {r.case.id: r for r in results}, fx, before


@pytest.mark.parametrize(
    "case", [pytest.param(c, id=c.id, marks=[pytest.mark.dist] if c.argv[0] == "torchrun" else []) for c in CASES]
)
def test_bad_input_is_rejected_cleanly(case, catalogue):
    results, _, _ = catalogue
    r = results[case.id]
    assert r.ok, f"{case.input}\n  " + "\n  ".join(r.problems) + f"\n----- output -----\n{r.stderr[-4000:]}"


def test_catalogue_covers_every_layout_rule_and_area():
    from megatron_bridge.parallel.rules import degrees, run, shapes, values

    names = {c.rule for c in CASES}
    # every Violation rule name the layout, run and value rules can produce is exercised by a case
    source = "".join(Path(m.__file__).read_text() for m in (degrees, shapes, run, values))
    produced = set(re.findall(r'_v\("([a-z-]+)"', source))
    assert produced <= names, f"layout rules without a catalogue case: {sorted(produced - names)}"
    assert len(CASES) >= 30
    assert {"config", "data", "checkpoint", "launch"} <= {c.area for c in CASES}


def test_shared_fixtures_untouched(catalogue):
    _, fx, before = catalogue
    assert cat.snapshot(fx) == before, "a case wrote into the shared fixtures"


def test_convert_cases_present_when_convert_exists():
    if not cat.convert_available():
        pytest.skip("`mbr convert` is not available: its catalogue cases are pending")
    assert {c.area for c in cat.convert_cases()} == {"convert"}


@pytest.mark.parametrize("how", ["HYDRA_FULL_ERROR=1", "debug=true"])
def test_debug_mode_shows_the_traceback(how, tmp_path):
    """The control: the same kind of input with HYDRA_FULL_ERROR=1 / debug=true does show one."""
    env = {k: v for k, v in os.environ.items() if k not in cat.CLEARED}
    args = ["recipe=default", "parallel.tp=3"]
    if how == "debug=true":
        args.append("debug=true")
    else:
        env["HYDRA_FULL_ERROR"] = "1"
    p = subprocess.run(
        [sys.executable, "-m", "megatron_bridge.train", *args],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert p.returncode != 0 and "Traceback" in p.stderr and "LayoutError" in p.stderr
    assert list(tmp_path.iterdir()) == []
