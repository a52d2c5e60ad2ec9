"""`train.compile=true`: `torch.compile` of every transformer layer of this rank's chunks.

Each layer is compiled in place (`nn.Module.compile`: parameter names, checkpoints, exports and
the schedules see the same module), so both backends and both engines share it: a backend
only names its layers (`BackendRuntime.layers`). Dynamo compiles at a layer's first call and
reuses the graph for every other layer of the same shape (parameters are graph inputs).
megatron-core's row-parallel linear warns on every call (`tp_group is None`, a
DeprecationWarning dynamo cannot reorder) and would split each graph there: `warnings.warn` is
a no-op inside compiled code (warnings raised inside a compiled layer are not shown), and its
tensor-parallel linear's once-only hint is marked given. Its TP linears run through
runtime/tp_linear.py (megatron's communication without the async overlap dynamo cannot
trace), so a layer is one graph at any TP degree. The graph breaks that remain are counted and
printed after the first step (docs/train.md "Compile").
"""

from __future__ import annotations

import warnings
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch
import torch._dynamo
from megatron.core.tensor_parallel import layers as tp_layers

from megatron_bridge.runtime.tp_linear import is_routed, matmul, route, tp_linears

_BASE: Counter = Counter()  # the breaks before the last compile_layers (a process may run several jobs)


def compile_layers(chunks: Sequence[Any], layers_of: Callable[[Any], Iterable[torch.nn.Module]]) -> int:
    """Compile every layer of `chunks` in place; how many."""
    torch._dynamo.config.ignore_logging_functions.add(warnings.warn)
    # its once-only CUDA_DEVICE_MAX_CONNECTIONS hint sets an attribute on a function, which dynamo
    # cannot trace: a graph break in every TP linear's call (the hint is a no-op warning here anyway)
    tp_layers.linear_with_grad_accumulation_and_async_allreduce.warned = True
    _BASE.clear()
    _BASE.update(graph_breaks())
    n = 0
    for chunk in chunks:
        for layer in layers_of(chunk):
            for lin in tp_linears(layer):
                if not is_routed(lin):  # float8 ones already are (runtime/fp8.py)
                    route(lin, matmul)
            layer.compile()
            n += 1
    return n


def graph_breaks() -> Counter:
    """{reason (its first line): count} of the graph breaks dynamo met so far in this process."""
    out: Counter = Counter()
    for reason, count in torch._dynamo.utils.counters["graph_break"].items():
        out[reason.strip().splitlines()[0][:160]] += count
    return out


def report(n_layers: int) -> str:
    """The line printed after the first compiled step."""
    breaks = graph_breaks() - _BASE
    head = f"train.compile: {n_layers} transformer layer(s) compiled on this rank (torch.compile, inductor)"
    if not breaks:
        return head + "; no graph breaks"
    top = "; ".join(f"{c}x {r}" for r, c in breaks.most_common(3))
    return head + f"; {sum(breaks.values())} graph break(s): {top}"


__all__ = ["compile_layers", "graph_breaks", "report"]
