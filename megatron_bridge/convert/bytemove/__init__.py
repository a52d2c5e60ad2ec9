"""Convert and export as byte moves: the rows' blocks as byte ranges, no tensors, no torch.

`direct` (HF -> megatron records: copy_file_range, column bands, zeros, CRC thread),
`direct_export` (megatron records -> HF tensors, checked against the manifest).
"""
