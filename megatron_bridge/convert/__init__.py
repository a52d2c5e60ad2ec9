"""Offline checkpoint conversion: HF safetensors <-> megatron-core checkpoints (docs/convert.md).

    mbr convert src=HF dst=OUT [format=torch_dist|torch] [parallel.tp=..] ...   pipeline.run.convert
    mbr export  src=OUT dst=HF                                                  pipeline.run.export
    mbr reshard src=OUT dst=OUT2 parallel.tp=.. parallel.pp=..                  pipeline.run.reshard

One process, CPU, no process group, no megatron-core import. Five layers, each importing
only from the ones above it in this list (tests/unit/convert/test_convert_layers.py checks it):

* `formats/` — the files, torch-free and model-free: safetensors (headers, positioned reads,
  streaming writer; the one reader `bridge.loader` uses too), `torch.save` zips record by
  record, torch's pickles and dtypes without torch, torch_dist (DCP + megatron metadata; the
  one reader of it, `train.init_from` included), and the manifest.
* `placement/` — where a model's tensors go in those files: Megatron's per-rank layout,
  torch_dist keys, the manifest's model and layout as bridge objects.
* `sources/` — a checkpoint read as bridge table rows: which rows an HF directory,
  torch_dist or per-rank checkpoint fills (validated against config.json), and "the HF
  tensors of this row" from each.
* `bytemove/` — without a cast, convert and export as byte ranges of the rows' blocks
  (copy_file_range, gathered writes; no tensors, no torch import).
* `pipeline/` — the commands: options and layout check, writers (tensor path, or the byte
  path where possible), atomic output, progress.

`command.py` is the commands' shared body (huge pages and read-ahead first). Loading a converted
checkpoint into a live model (`train.init_from=OUT`) is runtime work: `runtime/load_converted.py`.
"""
