"""The build side of the building blocks (their description is `bridge/features/`): each one
file, switched on by spec fields, with its megatron modules as ordinary classes.

See `base.py` for the hooks a block implements and `docs/bridge.md` for the list.
"""
