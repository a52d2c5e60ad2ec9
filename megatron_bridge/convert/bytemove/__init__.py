"""Convert, export and reshard as byte moves: the rows' blocks as byte ranges, no tensors, no torch.

`pieces` (a shard's blocks as byte pieces: spans, column bands, zeros, ...),
`strided` (strided views of one matrix: gather and scatter in memory),
`copier` (writes pieces: copy_file_range, gathered writes, zero buffer),
`checksums` (CRC-32 of source tensors on threads of their own),
`direct` (HF -> megatron records: when the byte path applies, the rows' sources, `DirectCopy`),
`direct_export` (megatron records -> HF tensors, checked against the manifest),
`direct_reshard` (megatron records -> megatron records: the two composed).
"""
