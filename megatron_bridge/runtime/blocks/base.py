"""The build hooks of the building blocks: how each one reaches megatron's TransformerConfig,
the per-layer module specs and the built model.

A block's description (config.json <-> BridgeSpec fields) is the core's
(`bridge/features/`); here is what building it takes. A block is one class in one file under
`runtime/blocks/`, listed in `BLOCK_MODULES` (the features' order), with its megatron and
torch modules as ordinary top-level classes:

    config(spec, kw)                TransformerConfig kwargs
    layer(spec, index, layer_spec)  edit one layer's ModuleSpec (a private copy; global 0-based index)
    block(spec, block_spec)         edit the block's TransformerBlockSubmodules (final norm)
    model(spec, chunk)              after GPTModel is built (hooks on embedding / output layer)

Every hook looks at the spec and does nothing unless the spec asks for its block. Shared code
(`tconfig.py`, `layer_specs.py`, `build.py`) calls every block's hooks in order and never
branches on a family.
"""

from __future__ import annotations

from typing import Any, ClassVar

from megatron_bridge.ordered_registry import OrderedRegistry

# modules under runtime/blocks that register blocks, in the order their hooks run
BLOCK_MODULES = (
    "attention",
    "rope",
    "mla",
    "moe_routing",
    "norms",
    "sublayer",
    "scaling",
    "qk_norm",
    "sinks",
    "bias",
    "glu",
    "expert_grads",
)


class Block:
    """Base of a building block's build hooks; every hook is optional (the default does nothing)."""

    name: ClassVar[str] = ""

    @classmethod
    def config(cls, spec: Any, kw: dict[str, Any]) -> None:
        """Adjust the TransformerConfig keyword arguments."""

    @classmethod
    def layer(cls, spec: Any, index: int, layer_spec: Any) -> None:
        """Edit the ModuleSpec of global layer `index` (0-based; a private deep copy)."""

    @classmethod
    def block(cls, spec: Any, block_spec: Any) -> None:
        """Edit the TransformerBlockSubmodules (its `layer_norm` is the final norm)."""

    @classmethod
    def model(cls, spec: Any, chunk: Any) -> None:
        """Adjust one built GPTModel chunk (pre_process/post_process tell which ends it has)."""


_REGISTRY: OrderedRegistry[type[Block]] = OrderedRegistry("megatron_bridge.runtime.blocks", BLOCK_MODULES, "block")
register_block = _REGISTRY.register
blocks = _REGISTRY.all  # every block, in `BLOCK_MODULES` order


__all__ = ["Block", "register_block", "blocks", "BLOCK_MODULES"]
