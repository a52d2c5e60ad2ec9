"""The transformers backend's runtime half: transformers' modules under megatron's parallel layers
(build.py: the stage pieces, the swaps; chunk.py: the chunk megatron's schedules run;
layers.py: the megatron layers in HF's places; weights.py: rank-local load, gathered export)."""
