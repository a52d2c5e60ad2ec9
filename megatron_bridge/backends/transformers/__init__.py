"""The transformers backend: transformers' own modeling code under megatron's parallel layers
and schedules, for an architecture with no native family (docs/bridge.md, "The transformers
backend"). `backend.py` is the backend object; `meta.py` the meta-device model it reads; `plan.py`
transformers' tp/pp plans and the tensor kinds; `overrides.py` what a model's forward computes
outside its modules, per model type; `kinds.py` the layer kinds; `experts.py`, `fused.py` the
tensors transformers converts between checkpoint and model; `aux.py` the router aux loss;
`checkpoint.py` what its checkpoints hold. Its runtime half is runtime/transformers/."""
