"""The file formats a conversion reads and writes, without torch and without a model.

`safetensors_io` (HF weights: validated headers, positioned reads, streaming writer),
`torch_zip` (`torch.save` files record by record), `pickling` and `dtypes` (torch's pickles
and dtypes by name), `dist_ckpt` / `dist_read` (torch_dist: DCP + megatron metadata, written / read), `placement`
(Megatron's per-rank "torch" layout: file names, which rank holds what), `manifest`
(`mbr_manifest.json`: what was written, with checksums).
"""
