"""Where a model's tensors go in each checkpoint format: the layer between the files and the rows.

`rank_files` (Megatron's per-rank "torch" layout: file names, which chunk of which rank holds
a parameter, Megatron-LM's `args`), `dist_keys` (a parameter's torch_dist key and position),
`manifest_model` (the manifest's model and layout as a `BridgeSpec` and a `Layout`).
"""
