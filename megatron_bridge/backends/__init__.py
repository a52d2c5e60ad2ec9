"""The backend seam: who describes, builds, names and counts a model (docs/contributing.md).

A backend owns four things: describing an HF config (config.json -> `BridgeSpec`), building
this rank's model chunks (runtime: `runtime/build.py` looks the builder up by
`spec.backend`), naming and sharding its checkpoint tensors (its weight table), and counting
its parameters. Shared code — rules, planner, converter, verify, LoRA, engines — asks
`backend_of(spec)` and never branches on which backend it is. `native` (megatron-core's
GPTModel from a family's declarations and the building blocks, native.py) and `hf`
(transformers' own modeling code under megatron's parallel layers, hf.py + hf_plan.py; its
builder is runtime/hf/), in the order `model.backend=auto` tries them (registry.py).

`describe(cfg.model)` (describe.py) is where a recipe's model group becomes the one
description, right after composition.
"""
