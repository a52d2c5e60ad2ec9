"""The conversion commands: checks first, then source -> writer into an atomic output.

`run` (`convert` / `export` / `reshard`), `options` (command fields, layout check),
`writers` (torch_dist, per-rank, HF; each fed by tensors or by `bytemove`), `writeback`
(early write-out for the tensor path), `progress` (bar and summary line).
"""
