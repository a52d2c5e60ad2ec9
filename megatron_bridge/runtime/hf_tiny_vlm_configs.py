"""The tiny-model rule's tables for vision-language models (runtime/hf_tiny.py, `vlm_architectures`): the
sizes every encoder sub-config (vision tower, audio tower, resampler) and the projector fields of the
composite config get, and the per-architecture overrides the rule cannot guess (each with its reason).
The language model keeps the text rule of hf_tiny_configs.py, so tp2 splits it as it splits a causal LM.
Plain data: no imports but the text rule's sizes."""

from __future__ import annotations

from typing import Any

from megatron_bridge.runtime.hf_tiny_configs import HIDDEN, VOCAB

ENCODER_LAYERS = 2
ENCODER_HIDDEN = 64
IMAGE = 32  # pixels per side of a square image: 4x4 patches of 8, so a 2x2 merge or pooling still leaves 4 tokens
PATCH = 8

# Every non-text sub-config of a VLM (and the sub-configs nested in it): a field the class has gets this value,
# over the text rule's (which would leave an encoder 96 wide, 4 layers deep, at its released image size).
ENCODER_SIZES: dict[str, Any] = {
    "hidden_size": ENCODER_HIDDEN,
    "embed_dim": ENCODER_HIDDEN,
    "d_model": ENCODER_HIDDEN,
    "intermediate_size": 128,
    "mlp_dim": 128,
    "encoder_ffn_dim": 128,
    "num_hidden_layers": ENCODER_LAYERS,
    "num_layers": ENCODER_LAYERS,
    "depth": ENCODER_LAYERS,
    "encoder_layers": ENCODER_LAYERS,
    "num_attention_heads": 4,
    "num_heads": 4,
    "encoder_attention_heads": 4,
    "num_key_value_heads": 4,
    "head_dim": 16,
    "image_size": IMAGE,
    "patch_size": PATCH,
    "projection_dim": ENCODER_HIDDEN,
    "output_channels": ENCODER_HIDDEN,
    # what an encoder hands the language model is the text hidden size
    "out_hidden_size": HIDDEN,
    "output_dim": HIDDEN,
    "text_hidden_size": HIDDEN,
    "adapter_in_dim": ENCODER_HIDDEN,  # Dots3: must equal the tower's width
    "adapter_input_size": ENCODER_HIDDEN,
    "adapter_out_dim": HIDDEN,
    # learned position tables: an 8x8 grid (interpolated to the image's own)
    "num_position_embeddings": 64,
    "position_embedding_size": 64,
    # indexes into the encoder's layers: its last layer runs full attention / feeds deepstack
    "fullatt_block_indexes": [ENCODER_LAYERS - 1],
    "deepstack_visual_indexes": [0],
    "global_attn_indexes": [ENCODER_LAYERS - 1],
    "insert_layer_id": 0,  # MiniCPM-V: the ViT merger after the first layer
    "window_size": 2 * 2 * PATCH,  # Qwen2.5-VL: in pixels, 2 merged tokens per side
    "vocab_size": VOCAB,
    "model_patch_size": PATCH,
    # adapters, necks and embedders inside an encoder
    "vision_output_dim": ENCODER_HIDDEN,
    "projector_input_dim": ENCODER_HIDDEN,
    "projector_output_dim": ENCODER_HIDDEN,
    "downsample_channels": [32, ENCODER_HIDDEN],
    "downsample_hidden_size": 32,
    "mm_embed_dim": ENCODER_HIDDEN,
    "mm_posemb_size": 64,
    "output_proj_dims": ENCODER_HIDDEN,
    "audio_embed_dim": ENCODER_HIDDEN,
    # a VQ image tokenizer: a small codebook, two resolution levels of few channels
    "base_channels": 32,  # group norms of 32 groups
    "latent_channels": 32,
    "num_embeddings": VOCAB,
    "channel_multiplier": [1, 2],
    "vision_use_head": False,  # SigLIP's pooling head: a VLM takes the patch states, never runs it
}

# The composite config's own widths (projectors, adapters between the encoder and the language model).
PROJECTOR_SIZES: dict[str, Any] = {
    "projector_hidden_size": 128,
    "projection_hidden_size": ENCODER_HIDDEN,  # Kimi-K2.5: the projector's pre-norm, over the tower's width
    "alignment_intermediate_size": 128,
    "vision_hidden_size": ENCODER_HIDDEN,
    "insert_layer_id": 0,  # MiniCPM-V keeps a copy of its vision config's
    "mm_tokens_per_image": 4,  # Gemma 3: the 4x4 patches average-pooled to 2x2
    # LLaVA-Next's any-resolution grids, in tiles of the tower's size (the first: an image of 1x2 tiles)
    "image_grid_pinpoints": [[IMAGE, 2 * IMAGE], [2 * IMAGE, IMAGE], [2 * IMAGE, 2 * IMAGE]],
}

# Image-side token ids (image, video, begin/end of image, ...) of the composite config are moved to the top of the
# tiny vocabulary, one distinct id each counting down from here, past the text config's own pad/bos/eos.
FIRST_SPECIAL = VOCAB - 1

# Per-architecture VLM tweaks the rule cannot guess: model_type -> (reason, fields). The fields win over the rule's;
# a dict value updates a sub-config's fields.
VLM_OVERRIDES: dict[str, tuple[str, dict[str, Any]]] = {
    "aria": (
        "the projector's query count per patch count is a table for 490/980 px images",
        {"projector_patch_to_query_dict": {(IMAGE // PATCH) ** 2: 4}},
    ),
    "deepseek_ocr2": (
        "mlp_layer_types has no default and the model indexes it per layer",
        {"text_config": {"mlp_layer_types": ["dense", "sparse"] * 2}},
    ),
    "dots3_note": (
        "the vision tower's stacked experts refuse MLP biases (the text rule switches them on)",
        {"vision_config": {"mlp_bias": False}},
    ),
    "ernie4_5_vl_moe": (
        "the text and vision experts have an intermediate size each (a list of two)",
        {"text_config": {"moe_intermediate_size": [56, 56]}},
    ),
    "gemma4": (
        "the vision pooler's 3x3 kernel: 2x2 pools the 8x4 patch grid to 8 tokens",
        {"vision_config": {"pooling_kernel_size": 2}},
    ),
    "gemma4_unified": (
        "merged model patches are patch_size x the pooling kernel (3) wide: 2 keeps 16 px patches, 32 per image",
        {"vision_config": {"pooling_kernel_size": 2}},
    ),
    "glm5_next": (
        "the indexer's top-k must be a multiple of its key pooling (16 by default); DSA layers are NoPE",
        {"text_config": {"index_kpool": 4, "qk_rope_head_dim": 0, "head_dim": 0}},
    ),
    "granite4_vision": (
        "the deepstack and spatial injections name vision and LLM layers by index (released: 24 and 40 deep), "
        "and the Q-Former downsample rate has no default",
        {
            "deepstack_layer_map": [[-1, 0], [-2, 1]],
            "spatial_target_layers": [0, 1, 2, 3],
            "downsample_rate": "1/2",
        },
    ),
    "janus": (
        "the vision tower's qk norm (off as released; the text rule switches it on) fails on a head-split query; "
        "the aligner maps to vision_config.projection_dim, which must be the text hidden size",
        {"vision_config": {"use_qk_norm": False, "projection_dim": HIDDEN}},
    ),
    "llama4": (
        "the vision adapter's fc1 takes the pixel-shuffled patches (hidden x 4): the vision MLP's intermediate size",
        {"vision_config": {"intermediate_size": ENCODER_HIDDEN * 4}},
    ),
    "muse_glimmer": (
        "the vision adapter takes out_hidden_size (the tower's width x 2x2 merged patches)",
        {"out_hidden_size": ENCODER_HIDDEN * 4},
    ),
    "muse_spark": (
        "the audio tower is a pyramid of one patch size, width and depth per stage (4 by default); the vision "
        "adapter takes out_hidden_size (the tower's width x 2x2 merged patches); the experts' own width",
        {
            "audio_config": {"num_hidden_layers": 4, "hidden_sizes": [16, 32, 32, 64]},
            "out_hidden_size": ENCODER_HIDDEN * 4,
            "text_config": {"moe_hidden_size": HIDDEN},
        },
    ),
    "paligemma": (
        "the projector maps to vision_config.projection_dim, which must be the text hidden size",
        {"projection_dim": HIDDEN, "vision_config": {"projection_dim": HIDDEN}},
    ),
    "qwen2_vl": (
        "the vision tower's hidden_size is the merger's output (the text hidden size); embed_dim is its width",
        {"vision_config": {"hidden_size": HIDDEN}},
    ),
    "vipllava": (
        "the projector concatenates the hidden states of 5 vision layers by index (-11 and 6 need a deep tower)",
        {"vision_feature_layer": [-3, -2, -1]},
    ),
}
