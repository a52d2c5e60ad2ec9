"""The tiny vision-language processor, model and image chats of the image-chat tests and the bad-input
catalogue (megatron_bridge/demo_vlm.py, which the demo's VLM step uses too)."""

from megatron_bridge.demo_vlm import (  # noqa: F401  (re-exported for the tests)
    MARKED,
    PIXELS,
    SPECIALS,
    TEMPLATE,
    TEXT_ONLY_TEMPLATE,
    image_chats,
    make_processor,
    make_vlm,
    png,
    png_bytes,
)
