"""A plain user-space copy of a directory: read() into one reused 8 MiB buffer, write() it out.

    python benchmarks/user_copy.py SRC DST

The reference convert_bench.py puts next to `cp -r`: GNU cp (coreutils >= 9) copies with
`copy_file_range`, inside the kernel, never bringing the bytes into the process. A
converter has to (to checksum and re-lay them out), so this loop — no transform, no
checksum, no Python objects per byte — is the floor for any user-space conversion of the
same bytes on the same machine.
"""

import os
import sys
from pathlib import Path


def copy_tree(src: Path, dst: Path, chunk: int = 8 * 2**20) -> int:
    buf = memoryview(bytearray(chunk))
    total = 0
    dst.mkdir(parents=True)
    for p in sorted(src.rglob("*")):
        out = dst / p.relative_to(src)
        if p.is_dir():
            out.mkdir(exist_ok=True)
            continue
        fi, fo = os.open(p, os.O_RDONLY), os.open(out, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        try:
            while n := os.readv(fi, [buf]):
                view = buf[:n]
                while view:
                    view = view[os.write(fo, view) :]
                total += n
        finally:
            os.close(fi)
            os.close(fo)
    return total


if __name__ == "__main__":
    copy_tree(Path(sys.argv[1]), Path(sys.argv[2]))
