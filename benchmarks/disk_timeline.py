"""What the disk does, 0.1 s at a time, while a command runs (then `sync`): MB/s read and
written and the fraction of time busy, from /proc/diskstats (Linux).

    python benchmarks/disk_timeline.py --device vda -- mbr convert src=... dst=... progress=off

Shows where a conversion leaves the disk idle (start-up, the manifest's CRC pass) and whether
reads and writes overlap — what an end-to-end time cannot show. The device is the whole disk
the files live on (`lsblk`); docs/benchmarks.md, "Read-ahead in window chunks", has two such
timelines.
"""

from __future__ import annotations

import argparse
import subprocess
import time


def snapshot(device: str) -> tuple[int, int, int]:
    """(sectors read, sectors written, ms busy) of `device` so far."""
    with open("/proc/diskstats") as f:
        for line in f:
            fields = line.split()
            if fields[2] == device:
                return int(fields[5]), int(fields[9]), int(fields[12])
    raise SystemExit(f"no device {device!r} in /proc/diskstats (see lsblk)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="vda")
    ap.add_argument("--every", type=float, default=0.1, help="seconds between samples")
    ap.add_argument("command", nargs=argparse.REMAINDER, help="-- then the command (run, then sync)")
    a = ap.parse_args()
    cmd = a.command[1:] if a.command[:1] == ["--"] else a.command
    start = time.perf_counter()
    child = subprocess.Popen(["sh", "-c", '"$@"; sync', "sh", *cmd])
    prev, then, rows = snapshot(a.device), start, []
    while child.poll() is None:
        time.sleep(a.every)
        now, cur = time.perf_counter(), snapshot(a.device)
        dt = now - then
        rd, wr, busy = ((c - p) for c, p in zip(cur, prev))
        rows.append((now - start, rd * 512 / 1e6 / dt, wr * 512 / 1e6 / dt, busy / 1000 / dt))
        prev, then = cur, now
    print("| s | read MB/s | written MB/s | busy |\n|---|---|---|---|")
    for t, r, w, b in rows:
        print(f"| {t:.1f} | {r:.0f} | {w:.0f} | {b:.2f} |")
    idle = sum(a.every for *_, b in rows if b < 0.5)
    print(
        f"{rows[-1][0] if rows else 0:.1f} s until on disk; under half busy for {idle:.1f} s; exit {child.returncode}"
    )


if __name__ == "__main__":
    main()
