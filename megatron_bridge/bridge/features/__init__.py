"""Building blocks the megatron local spec lacks: how each is read from and written to
config.json (one file each, switched on by spec fields; their build hooks are
`runtime/blocks/`).

See `base.py` for the hooks a feature implements and `docs/bridge.md` for the list.
"""
