"""The rank grid: which global rank holds which (tp, cp, ep, dp, pp) coordinate.

Reproduces megatron-core's `RankGenerator` with order "tp-cp-ep-dp-pp" (TP innermost,
PP outermost) as numpy index arithmetic, so `mbr check` can print and the planner can
reason about 16,384 ranks without creating a process group. Two grids, as in
megatron-core: the dense one (tp, cp, dp, pp) for attention/dense layers and the expert
one (etp, ep, expert-dp, pp) for MoE layers. The runtime test asserts megatron's real
groups equal these.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import numpy as np

from megatron_bridge.parallel.dims import ParallelDims

ORDER = ("tp", "cp", "ep", "dp", "pp")  # innermost first, megatron-core's default order

# Group name -> (grid, axes). Names follow megatron-core's parallel_state getters.
GROUPS: dict[str, tuple] = {
    "tp": ("dense", ("tp",)),
    "cp": ("dense", ("cp",)),
    "dp": ("dense", ("dp",)),
    "pp": ("dense", ("pp",)),
    "dp_cp": ("dense", ("cp", "dp")),
    "tp_cp": ("dense", ("tp", "cp")),
    "mp": ("dense", ("tp", "pp")),  # model-parallel group (tp-pp)
    "ep": ("expert", ("ep",)),
    "etp": ("expert", ("tp",)),
    "edp": ("expert", ("dp",)),
}


def rank_groups(sizes: dict[str, int], axes: tuple) -> np.ndarray:
    """All groups varying along `axes`, as an array (n_groups, group_size).

    Same result and order as megatron-core's `generate_masked_orthogonal_rank_groups`:
    groups enumerate the other axes innermost-first, members enumerate `axes`
    innermost-first."""
    names = list(ORDER)
    world = int(np.prod([sizes[n] for n in names]))
    grid = np.arange(world).reshape([sizes[n] for n in reversed(names)])  # axis 0 = pp
    outer = [len(names) - 1 - names.index(n) for n in reversed(names) if n not in axes]
    inner = [len(names) - 1 - names.index(n) for n in reversed(names) if n in axes]
    size = int(np.prod([sizes[n] for n in axes]))
    return grid.transpose(outer + inner).reshape(-1, size)


@dataclass(frozen=True)
class Topology:
    dims: ParallelDims

    @property
    def world_size(self) -> int:
        """The run's processes: a rank map exists only for dims resolved against a world."""
        assert self.dims.world_size is not None, "a rank map needs a world size (ParallelDims.with_world)"
        return self.dims.world_size

    @property
    def gpus_per_node(self) -> int:
        assert self.dims.gpus_per_node is not None, "a rank map needs the GPUs per node"
        return self.dims.gpus_per_node

    @cached_property
    def _sizes(self) -> dict[str, dict[str, int]]:
        d = self.dims
        return {
            "dense": {"tp": d.tp, "cp": d.cp, "ep": 1, "dp": d.dp, "pp": d.pp},
            "expert": {"tp": d.etp, "cp": 1, "ep": d.ep, "dp": d.expert_dp, "pp": d.pp},
        }

    def groups(self, name: str) -> np.ndarray:
        """Rank groups of one kind (see GROUPS), shape (n_groups, group_size)."""
        grid, axes = GROUPS[name]
        return rank_groups(self._sizes[grid], axes)

    @cached_property
    def coords(self) -> dict[str, np.ndarray]:
        """Per-rank coordinate along each axis, arrays of length world_size."""
        r = np.arange(self.world_size)
        out = {}
        for grid, prefix in (("dense", ""), ("expert", "e")):
            s, stride = self._sizes[grid], 1
            for n in ORDER:
                key = {"ep": "ep", "tp": prefix + "tp", "dp": prefix + "dp"}.get(n, n)
                if grid == "dense" and n == "ep" or grid == "expert" and n in ("cp", "pp"):
                    stride *= s[n]
                    continue
                out[key] = (r // stride) % s[n]
                stride *= s[n]
        out["node"] = r // self.gpus_per_node
        out["local"] = r % self.gpus_per_node
        return out

    def intra_node(self, name: str) -> bool:
        """True when every group of this kind lies inside one node."""
        nodes = self.groups(name) // self.gpus_per_node
        return bool((nodes == nodes[:, :1]).all())

    def span_summary(self, moe: bool = True) -> dict[str, str]:
        """For each group kind with size > 1: 'intra-node' or 'inter-node'. Expert groups
        only when `moe` (a dense model has no expert layers)."""
        out = {}
        for name in GROUPS:
            if not moe and GROUPS[name][0] == "expert":
                continue
            g = self.groups(name)
            if g.shape[1] > 1:
                out[name] = "intra-node" if self.intra_node(name) else "inter-node"
        return out

    def group_of(self, name: str, rank: int) -> list[int]:
        g = self.groups(name)
        row = np.nonzero((g == rank).any(axis=1))[0][0]
        return g[row].tolist()

    def format_rank_map(self, max_nodes: int = 4, moe: bool = True) -> str:
        """Printable rank map: per node, each rank's coordinates and group members.
        Beyond `max_nodes` nodes only the first and last ones are shown."""
        d, c = self.dims, self.coords
        kinds = [k for k in ("tp", "cp", "dp", "pp") + (("ep", "edp") if moe else ()) if self.groups(k).shape[1] > 1]
        member = {k: {int(r): g for g in self.groups(k).tolist() for r in g} for k in kinds}
        n_nodes = d.nodes
        shown = list(range(n_nodes))
        if n_nodes > max_nodes:
            shown = list(range(max_nodes // 2)) + list(range(n_nodes - max_nodes // 2, n_nodes))
        head = f"{'rank':>6} {'local':>5}  {'tp':>3} {'cp':>3} {'ep':>3} {'dp':>5} {'pp':>4}  groups"
        lines = []
        for i, node in enumerate(shown):
            if i and shown[i - 1] != node - 1:
                lines.append(f"... {node - shown[i - 1] - 1} more node(s) ...")
            lines.append(f"node {node}:")
            lines.append(head)
            for r in range(node * self.gpus_per_node, (node + 1) * self.gpus_per_node):
                grp = " ".join(f"{k}={_short(member[k][r])}" for k in kinds)
                lines.append(
                    f"{r:>6} {int(c['local'][r]):>5}  {int(c['tp'][r]):>3} {int(c['cp'][r]):>3} "
                    f"{int(c['ep'][r]):>3} {int(c['dp'][r]):>5} {int(c['pp'][r]):>4}  {grp}"
                )
        spans = self.span_summary(moe)
        if spans:
            lines.append("group placement: " + ", ".join(f"{k} {v}" for k, v in spans.items()))
        return "\n".join(lines)


def _short(ranks: list[int]) -> str:
    """[0,1,2,3] -> '0-3', [0,8,16] -> '0,8,16', long lists abbreviated."""
    if len(ranks) > 1 and all(b - a == 1 for a, b in zip(ranks, ranks[1:])):
        return f"{ranks[0]}-{ranks[-1]}"
    if len(ranks) > 6:
        step = ranks[1] - ranks[0]
        if all(b - a == step for a, b in zip(ranks, ranks[1:])):
            return f"{ranks[0]}..{ranks[-1]}/+{step}"
        return ",".join(map(str, ranks[:3])) + f",...({len(ranks)})"
    return ",".join(map(str, ranks))
