"""Hugging Face models ⇄ megatron-core parallel models: the description (see docs/bridge.md).

    from megatron_bridge.bridge.hf_config import load_spec
    spec = load_spec(hf_dir)                      # HF config.json -> BridgeSpec (refuses what it can't do)

The weight tables (`families/`, rows of `table.Mapping`) are pure tensor functions (the
transforms in `mapping.py` and `stacked.py`, over `shards.py`'s blocks), shared by online
loading, export and offline conversion (`loader.rank_shards`). The package is torch-free
(`mbr convert` never needs torch), and this file re-exports nothing: import a name from the
module that holds it. Building, loading and exporting a live model is the runtime's:

    from megatron_bridge.runtime.build import build_model
    from megatron_bridge.runtime.weights import export_hf_weights, load_hf_weights

    chunks = build_model(spec, Layout(tp=2, pp=2), load_weights=True)   # this rank's chunk(s), no random init
    load_hf_weights(chunks, spec, hf_dir)         # each rank reads only its slices
    export_hf_weights(chunks, spec, out_dir, source_dir=hf_dir)   # back to HF names/shapes
"""
