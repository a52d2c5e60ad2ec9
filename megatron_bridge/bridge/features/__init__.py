"""Building blocks the megatron local spec lacks, each one file, switched on by spec fields.

See `base.py` for the hooks a feature implements and `docs/bridge.md` for the list.
"""
