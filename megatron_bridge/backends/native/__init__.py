"""The native backend: megatron-core's GPTModel built from a family's declarations
(bridge/families/) and the building blocks (bridge/features/, runtime/blocks/) — the curated,
fast path (`backend.py`), and its checkpoints in megatron-core's own names (`checkpoint.py`).
Its runtime half is runtime/native/."""
