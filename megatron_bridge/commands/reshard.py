"""`mbr reshard`: a converted checkpoint -> the same weights in another layout, without HF.

    mbr reshard src=OUT dst=OUT2 parallel.tp=4 parallel.pp=1            # per-rank files at tp4
    mbr reshard src=OUT dst=OUT2 format=torch_dist                      # per-rank -> torch_dist

Reads either format, writes per-rank torch files for `parallel.*` (default) or torch_dist.
Without a cast the target shards are byte moves from the source records (export's pieces
composed with the target's blocks, convert/bytemove/direct_reshard.py); otherwise each
parameter's shards are merged and re-split with the bridge's mapping. Both are checked
against the manifest's checksums and give the same bytes; A -> B -> A is bit-exact. See
docs/convert.md.
"""

from __future__ import annotations

from collections.abc import Sequence

from megatron_bridge.convert.command import run_command


def main(argv: Sequence[str]) -> int:
    return run_command(argv, "ReshardConfig", "reshard", __doc__)
