"""Where a model's tensors go in each checkpoint format: the layer between the files and the rows.

`rank_files` (Megatron's per-rank "torch" layout: file names, which chunk of which rank holds
a tensor — the backend's `owned` —, the stored `args` and state), `manifest_model` (the
manifest's model and layout as a `BridgeSpec` and a `Layout`). A tensor's torch_dist key is its
backend's (`Backend.dist_location`: backends/native/checkpoint.py, backends/transformers/checkpoint.py).
"""
