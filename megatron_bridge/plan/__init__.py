"""`mbr plan`: the parallelism decision framework (docs/plan.md) as a tool.

params.py      exact parameter counts (total, active, per rank) of a native description
shards.py      any backend's parameters by stage piece and split (`Backend.shards`): every per-rank count
memory.py      per-GPU memory: model states per ZeRO stage, activations, logits, margin
comm.py        per-dimension communication per step at the link each group spans; bubble
evaluation.py  one layout's memory, communication and step time; the framework's ranking key
search.py      enumerate layouts, validate them with parallel.rules, keep the best per structure
explain.py     why each runner-up lost, why a layout does not fit, what would fit instead
report.py      the JSON document (docs/plan.md) and the table

Nothing here imports torch, and the search is plain arithmetic, so a user can plan a
16,384-GPU cluster interactively (timings: docs/benchmarks.md).
"""
