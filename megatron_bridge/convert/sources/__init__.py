"""A checkpoint read as bridge table rows.

`rows` (which rows a checkpoint fills, checked against the backend's model before anything is
written), `readers` (HF directory, torch_dist, per-rank files -> the HF tensors of one row,
with checksums and a read-ahead thread), `hf_view` (a converted checkpoint seen as an HF
directory's tensors: what the transformers backend loads one through), `preflight` (what a
directory to start training from is, checked before anything loads it).
"""
