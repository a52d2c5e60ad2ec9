"""Tiny torchrun worker for the harness tests (no torch import, so a launch takes ~2 s).

harness_probe.py report ARG...   each rank reports its env, ARGs and its launcher's module
harness_probe.py fail            rank 1 prints a marker and exits with code 3
harness_probe.py hang PID_DIR    every rank writes its pid to PID_DIR, then sleeps forever
"""

import os
import sys
import time

from megatron_bridge.testing import report

mode, args = sys.argv[1], sys.argv[2:]
rank = int(os.environ["RANK"])
if mode == "report":
    report({"rank": rank, "world": int(os.environ["WORLD_SIZE"]), "args": args})
    report({"second": True})  # reports of one rank merge
    with open(f"/proc/{os.getppid()}/cmdline", "rb") as f:  # python -m MODULE ...: the launcher
        report({"launcher": f.read().split(b"\0")[2].decode()})
elif mode == "fail":
    if rank == 1:
        print("PROBE-FAILURE-MARKER", flush=True)
        sys.exit(3)
    report({"rank": rank})
elif mode == "hang":
    with open(os.path.join(args[0], f"{os.getpid()}.pid"), "w") as f:
        f.write(str(os.getpid()))
    while True:
        time.sleep(1)
