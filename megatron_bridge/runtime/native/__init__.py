"""The native backend's runtime half: megatron-core GPTModels from a family's declarations
(`build.py`), HF weights into and out of them (`weights.py`), converted checkpoints loaded by
megatron-core's own statement of where each shard is stored (`converted.py`)."""
