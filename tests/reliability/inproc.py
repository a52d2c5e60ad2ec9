"""Run catalogue cases in one interpreter: `python -m tests.reliability.inproc SPEC.json OUT.json`.

Each case calls the very function the console scripts call — `megatron_bridge.cli.main(argv)`
(`mbr`) or `megatron_bridge.train.runner.main(argv)` (`python -m megatron_bridge.train`), which
return the exit code the script would exit with — inside its own working directory and
environment, with stdout/stderr captured. An exception escaping them is recorded with its
traceback (what the script would print). This saves the interpreter start and the imports per
case (~0.5-4 s); a few cases per area also run as real subprocesses (catalogue.py).
"""

from __future__ import annotations

import io
import json
import os
import sys
import time
import traceback
from contextlib import redirect_stderr, redirect_stdout

CLEARED = ("WORLD_SIZE", "RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "HYDRA_FULL_ERROR", "MBR_FAULT")


def run_one(spec: dict) -> dict:
    from megatron_bridge import cli
    from megatron_bridge.train import runner

    home, saved = os.getcwd(), dict(os.environ)
    os.chdir(spec["cwd"])
    for k in CLEARED:
        os.environ.pop(k, None)
    os.environ.update(spec["env"])
    out, err = io.StringIO(), io.StringIO()
    t0 = time.monotonic()
    try:
        with redirect_stdout(out), redirect_stderr(err):
            entry = cli.main if spec["entry"] == "mbr" else runner.main
            rc = entry(list(spec["argv"]))
    except SystemExit as e:
        rc = e.code if isinstance(e.code, int) else 1
    except BaseException:  # what the interpreter would print, and its exit status
        err.write(traceback.format_exc())
        rc = 1
    finally:
        os.environ.clear()
        os.environ.update(saved)
        os.chdir(home)
    return {
        "id": spec["id"],
        "rc": rc,
        "stderr": err.getvalue(),
        "stdout": out.getvalue(),
        "seconds": time.monotonic() - t0,
    }


def main() -> None:
    specs = json.loads(open(sys.argv[1]).read())
    results = []
    for spec in specs:
        results.append(run_one(spec))
        with open(sys.argv[2], "w") as f:  # after each case: a crash loses only the rest
            json.dump(results, f)


if __name__ == "__main__":
    main()
