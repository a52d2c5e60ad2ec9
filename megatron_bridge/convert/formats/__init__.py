"""The file formats a conversion reads and writes, without torch and without a model.

`safetensors_io` (HF weights: validated headers, positioned reads, streaming writer),
`torch_zip` / `torch_zip_read` (`torch.save` files written / read record by record), `pickling` and `dtypes` (torch's pickles
and dtypes by name), `dist_ckpt` / `dist_read` (torch_dist: DCP + megatron metadata, written /
read), `fp8` (block-quantised safetensors), `manifest` (`mbr_manifest.json`: what was
written, with checksums). Nothing here imports the bridge or any other model description
(tests/unit/convert/test_convert_layers.py): which tensor goes where is `placement/`'s.
"""
