"""The backend seam: who describes, builds, names and counts a model (docs/contributing.md).

A backend is one object (`base.Backend`), registered once (`registry.BACKENDS`, in the order
`model.backend=auto` tries them): it describes a config (config.json -> `BridgeSpec`), counts
the model, states what it cannot do as rules (layout and run limits), names and shards its
checkpoint tensors (its weight table) and tells the offline converter where each is stored
(`expected`, `dist_location`, `owned`, `rank_state`). Its runtime half — building this rank's
chunks, loading and exporting weights — is one object too, in the runtime layer
(`runtime/runtimes.py`). Shared code — rules, planner, converter, verify, LoRA, engines — asks
`backend_of(spec)` for capabilities and never tests which backend it is (tests/unit/test_backend_seam.py).

* `native/`: megatron-core's GPTModel from a family's declarations (bridge/families/) and the
  building blocks; its checkpoints are megatron-core's names (native/checkpoint.py).
* `transformers/`: transformers' own modeling code under megatron's parallel layers, for any
  architecture transformers ships with a tp plan (backend.py; meta.py: the meta-device model;
  plan.py: transformers' tp/pp plans; overrides.py: what a model's forward computes outside its
  modules; kinds.py, experts.py, fused.py, aux.py; checkpoint.py: its checkpoints).

`describe(cfg.model)` (describe.py) is where a recipe's model group becomes the one
description, right after composition.
"""
