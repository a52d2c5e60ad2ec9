"""An optimizer's per-parameter state keyed by the parameter's name: what a training checkpoint stores.

megatron-core's own state dicts key Adam's state by position (the plain optimizer by index in
its param groups, the distributed optimizer by this DP rank's share of the buffers in bucket
order), so only a run of the same layout could read them back. Stored under the parameter's
table name (global layer and expert indices: the backend's `global_names`) with the flat range
of the rank's (TP-local) parameter it covers, the state says what it is: `mbr reshard` puts each
parameter's state together from the ranks' ranges, merges it over TP with the weight's own
transform and splits it for another layout (train/reshard.py), and a run loads its own range from
any entry that covers it — its own save, or a resharded one holding the whole tensor.

An entry: `range` (start, end) in the flattened local parameter, `shape` of the local parameter,
the optimizer's state tensors (`exp_avg`, `exp_avg_sq` flat over the range; `step` as it is) and
`param`, the fp32 main copy, where the optimizer keeps one apart from the model's weight.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import torch
from megatron.core.optimizer import DistributedOptimizer

from megatron_bridge.errors import UserError

Entry = dict[str, Any]


def dist_model_params(opt: DistributedOptimizer) -> list[torch.nn.Parameter]:
    """Model params in the DistributedOptimizer's bucket order (stable for a layout)."""
    out = []
    for gbuf_range_maps in opt.gbuf_ranges:
        for per_bucket in gbuf_range_maps.values():
            for bucket in per_bucket:
                out += list(bucket["param_map"].keys())
    return out


def _plain_pairs(opt: Any, model_params: Iterable[torch.nn.Parameter]) -> list[tuple[torch.nn.Parameter, Any]]:
    """(model param, main param) of a plain megatron optimizer: the fp32 copy a mixed-precision
    one keeps (`param.main_param`), else the parameter itself."""
    by_main = {id(getattr(p, "main_param", p)): p for p in model_params}
    return [(by_main[id(m)], m) for g in opt.optimizer.param_groups for m in g["params"] if id(m) in by_main]


def _flat(v: torch.Tensor) -> torch.Tensor:
    return v.detach().reshape(-1).clone() if v.dim() else v.detach().clone()


def named_state(opt: Any, names: Mapping[int, str], model_params: Iterable[torch.nn.Parameter]) -> dict[str, Entry]:
    """{parameter name: entry} of one megatron optimizer (`names`: id(model param) -> name)."""
    out: dict[str, Entry] = {}
    if isinstance(opt, DistributedOptimizer):
        for p in dist_model_params(opt):
            r = opt._get_model_param_range_map(p)["param"]
            tensors = opt._get_main_param_and_optimizer_states(p)
            out[names[id(p)]] = {"range": (r.start, r.end), "shape": tuple(p.shape)} | {
                k: _flat(v) for k, v in tensors.items()
            }
        return out
    for p, main in _plain_pairs(opt, model_params):
        entry: Entry = {"range": (0, p.numel()), "shape": tuple(p.shape)}
        if main is not p:
            entry["param"] = _flat(main)
        entry.update({k: _flat(v) for k, v in opt.optimizer.state.get(main, {}).items()})
        out[names[id(p)]] = entry
    return out


def _mine(entry: Entry, start: int, end: int, name: str) -> dict[str, torch.Tensor]:
    """The tensors of `entry` for the flat range [start, end) of its parameter."""
    a, b = entry["range"]
    if not a <= start <= end <= b:
        raise UserError(
            f"the checkpoint's optimizer state of {name} covers elements {a}..{b} of it, this rank needs "
            f"{start}..{end}: it was written for another layout (mbr reshard makes one for this layout)"
        )
    out = {}
    for k, v in entry.items():
        if k in ("range", "shape"):
            continue
        out[k] = v[start - a : end - a].clone() if v.dim() else v.clone()
    return out


@torch.no_grad()
def load_named_state(
    opt: Any, names: Mapping[int, str], model_params: Iterable[torch.nn.Parameter], saved: Mapping[str, Entry]
) -> None:
    """Put each parameter's entry (or this rank's range of it) into `opt`. Every state tensor
    is its own clone: megatron's own `load_state_dict` path shares one `step` tensor between all
    params, which Adam then increments once per param (a resumed run would drift)."""

    def entry(p: torch.nn.Parameter) -> Entry:
        name = names[id(p)]
        if name not in saved:
            raise UserError(f"the checkpoint has no optimizer state for {name}: it holds another model's")
        e = saved[name]
        if tuple(e["shape"]) != tuple(p.shape):
            raise UserError(
                f"the checkpoint's optimizer state of {name} is for a {list(e['shape'])} shard, this rank holds "
                f"{list(p.shape)}: it was written for another layout (mbr reshard makes one for this layout)"
            )
        return e

    if isinstance(opt, DistributedOptimizer):
        for p in dist_model_params(opt):
            r = opt._get_model_param_range_map(p)["param"]
            tensors = _mine(entry(p), r.start, r.end, names[id(p)])
            gi, go = opt.model_param_group_index_map[p]
            main = opt.optimizer.param_groups[gi]["params"][go]
            # no main copy saved (the optimizer that wrote it trained on the weights themselves):
            # the weight just loaded is it
            main.copy_(tensors.pop("param") if "param" in tensors else p.detach().reshape(-1)[r.start : r.end])
            opt.optimizer.state[main] = tensors
        return
    for p, main in _plain_pairs(opt, model_params):
        tensors = _mine(entry(p), 0, p.numel(), names[id(p)])
        if "param" in tensors:
            main.copy_(tensors.pop("param").view(main.shape))
        elif main is not p:
            main.copy_(p.detach())
        if tensors:
            opt.optimizer.state[main] = {k: v.view(main.shape) if v.dim() else v for k, v in tensors.items()}


__all__ = ["Entry", "dist_model_params", "load_named_state", "named_state"]
