"""A checkpoint read as bridge table rows.

`rows` (which rows a checkpoint fills, checked against its config.json before anything is
written), `readers` (HF directory, torch_dist, per-rank files -> the HF tensors of one row,
with checksums and a read-ahead thread).
"""
