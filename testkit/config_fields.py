"""The config fields ``testkit.families.tiny_config`` sets, by name, wherever a config (or a nested
config) has them: sizes (``SIZES``), windows, per-layer index lists, fields zeroed, and the short
table of per-family ``OVERRIDES`` where the generic shrink is not enough. Data only."""

from __future__ import annotations

from typing import Any

VOCAB = 128
MAX_POSITIONS = 512

# Size fields, by name, wherever a config (or a nested config) has them.
WIDTH = (
    "hidden_size",
    "n_embd",
    "d_model",
    "emb_dim",
    "embedding_dim",
    "embedding_size",
    "word_embed_proj_dim",
    "input_embedding_size",
    "output_embedding_size",
    "lru_width",
    "attention_hidden_size",
    "backbone_hidden_size",
    "hidden_size_global",
)
FFN = (
    "intermediate_size",
    "n_inner",
    "ffn_dim",
    "decoder_ffn_dim",
    "encoder_ffn_dim",
    "ffn_hidden_size",
    "dff",
    "dim_ff",
    "d_inner",
    "feed_forward_size",
    "intermediate_size_mlp",
    "dense_intermediate_size",
)
DEPTH = (
    "num_hidden_layers",
    "n_layer",
    "n_layers",
    "num_layers",
    "decoder_layers",
    "encoder_layers",
    "num_decoder_layers",
    "num_encoder_layers",
    "num_layers_per_stack",
)
HEADS = (
    "num_attention_heads",
    "n_head",
    "n_heads",
    "attention_heads",
    "decoder_attention_heads",
    "encoder_attention_heads",
    "num_decoder_attention_heads",
    "num_encoder_attention_heads",
    "swa_num_attention_heads",
)
KV_HEADS = ("num_key_value_heads", "num_kv_heads", "swa_num_key_value_heads", "kv_n_heads", "multi_query_group_num")
HEAD_DIM = (
    "head_dim",
    "attention_head_dim",
    "attention_head_size",
    "d_head",
    "dim_head",
    "kv_channels",
    "swa_head_dim",
    "index_head_dim",
    "linear_key_head_dim",
    "linear_value_head_dim",
    "linear_head_dim",
    "mamba_d_head",
    "mamba_head_dim",
    "mamba_headdim",
)
POSITIONS = (
    "max_position_embeddings",
    "n_positions",
    "n_ctx",
    "max_seq_len",
    "max_target_positions",
    "context_length",
    "original_max_position_embeddings",
)
SIZES: dict[str, Any] = {
    **dict.fromkeys(("vocab_size", "decoder_vocab_size", "vocab_size_per_layer_input", "unpadded_vocab_size"), VOCAB),
    **dict.fromkeys(("pronunciation_vocab_size", "shape_vocab_size", "encoder_hash_byte_group_vocab"), 32),
    **dict.fromkeys(WIDTH, 64),
    **dict.fromkeys(("pronunciation_embed_dim", "shape_embed_dim", "router_hidden_size", "ple_embed_dim"), 16),
    **dict.fromkeys(FFN, 96),
    **dict.fromkeys(DEPTH, 2),
    **dict.fromkeys(HEADS, 4),
    **dict.fromkeys(KV_HEADS, 2),
    **dict.fromkeys(HEAD_DIM, 16),
    **dict.fromkeys(POSITIONS, MAX_POSITIONS),
    # mixture of experts
    **dict.fromkeys(("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts"), 4),
    **dict.fromkeys(("num_experts_per_tok", "num_experts_per_token", "moe_k", "moe_topk", "moe_top_k"), 2),
    **dict.fromkeys(
        (
            "moe_intermediate_size",
            "shared_expert_intermediate_size",
            "shared_experts_intermediate_size",
            "shared_intermediate_size",
            "moe_shared_expert_intermediate_size",
            "expert_ffn_hidden_size",
        ),
        32,
    ),
    **dict.fromkeys(
        (
            "n_shared_experts",
            "num_shared_experts",
            "n_group",
            "topk_group",
            "num_expert_group",
            "first_k_dense_replace",
        ),
        1,
    ),
    # state-space / linear-attention layers
    **dict.fromkeys(("state_size", "ssm_state_size", "mamba_d_state", "time_step_rank", "mamba_dt_rank"), 8),
    **dict.fromkeys(("mamba_n_heads", "mamba_num_heads", "n_mamba_heads"), 8),  # 8 x 16 = expand (2) x hidden (64)
    **dict.fromkeys(("mamba_chunk_size", "chunk_size"), 16),
    **dict.fromkeys(("n_groups", "mamba_n_groups"), 1),
    "mamba_d_ssm": 128,
    **dict.fromkeys(("linear_num_key_heads", "index_n_heads"), 2),
    **dict.fromkeys(("linear_num_value_heads", "linear_num_heads"), 4),
    # multi-head latent attention (v_head_dim: see the `mla` variant)
    "q_lora_rank": 32,
    "kv_lora_rank": 16,
    "qk_rope_head_dim": 8,
    "qk_nope_head_dim": 16,
    "qk_head_dim": 24,
    "v_head_dim": 24,
    "o_lora_rank": 16,
    # low-rank side paths
    **dict.fromkeys(("adapter_rank", "laurel_rank", "gated_norm_rank", "loop_gate_rank", "hc_lowrank"), 8),
    "rotary_dim": 8,
    "hidden_size_per_layer_input": 16,
    "zero_expert_num": 2,
}
# Windows: as long as max_position_embeddings (no effect on a test sequence) unless `sliding` asks.
WINDOWS = (
    "sliding_window",
    "sliding_window_size",
    "attention_window_size",
    "window_size",
    "attention_chunk_size",
    "local_attention",
    "local_attention_window_len",
)
# Per-layer lists of layer indices (membership is a kind of layer).
INDEX_LISTS = (
    "moe_layers",
    "mlp_only_layers",
    "full_attn_idxs",
    "hybrid_layer_ids",
    "attn_layer_indices",
    "ple_layer_ids",
)
DERIVED = ("kv_sharing_modes",)  # per-layer properties derived from the fields handled here
ZERO = ("router_jitter_noise", "jitter_noise", "layerdrop", "decoder_layerdrop", "encoder_layerdrop")

# Logit soft-capping that changes the tiny model: larger scores (weights, 1 / sqrt(16)) against a cap of
# 1 change a q_proj gradient of gemma2 by a quarter.
SOFTCAP_BITES = {"attn_logit_softcapping": 1.0, "initializer_range": 0.1, "query_pre_attn_scalar": 16}

# Where the generic shrink is not enough: model_type -> (fields, why). Keep it short.
OVERRIDES: dict[str, tuple[dict[str, Any], str]] = {
    "gemma2": (SOFTCAP_BITES, "the tiny model's scores never reach the cap of 50: soft-capping would go untested"),
    "vaultgemma": (SOFTCAP_BITES, "the tiny model's scores never reach the cap of 50: soft-capping would go untested"),
    "recurrent_gemma": ({"num_hidden_layers": 3}, "block_types cycles (recurrent, recurrent, attention)"),
    "mamba2": ({"num_heads": 8}, "num_heads is the SSM head count: 8 x head_dim 16 = expand 2 x hidden 64"),
    "kolibri1_1": ({"index_num_heads": 1, "head_dim": 16}, "the indexer reads at most the query heads of key head 0"),
    "bamba": ({"attn_layer_indices": [1]}, "the default has no attention layer"),
    "granitemoehybrid": ({"layer_types": ["linear_attention", "full_attention"]}, "the default has no attention layer"),
    "lfm2": ({"layer_types": ["conv", "full_attention"]}, "the default has no conv layer"),
    "lfm2_moe": ({"layer_types": ["conv", "full_attention"]}, "the default has no layer_types (the model needs them)"),
    "cohere_compass_text": (
        {"rope_parameters": {"full_attention": {"rope_type": "default", "rope_theta": 10000.0}}},
        "the default has no RoPE parameters per layer type (the model needs them)",
    ),
    "dbrx": (
        {"attn_config": {"kv_n_heads": 2, "rope_theta": 10000.0, "clip_qkv": 8.0}},
        "the model reads attn_config.rope_theta and clip_qkv, which the default attention config leaves unset",
    ),
    "gpt_neo": ({"attention_types": [[["global", "local"], 1]]}, "attention_types must spell out num_layers (2)"),
    "zamba": (
        {"num_hidden_layers": 5, "attn_layer_period": 2, "attn_layer_offset": 1, "attention_hidden_size": 128},
        "the shared attention block is tied across hybrid layers (needs two of them) and reads 2 x hidden",
    ),
    "xlstm": (
        {"num_heads": 4, "qk_dim_factor": 1.0, "mode": "train", "chunk_size": 1},
        "the chunkwise kernel's state buffers assume qk dim == v dim, inference mode has no backward, "
        "and the sequence must be a multiple of chunk_size",
    ),
    "xmod": ({"default_language": "en_XX"}, "the model needs a default language adapter"),
    "reformer": ({"axial_pos_embds": False}, "axial position embeddings need the sequence to fill axial_pos_shape"),
    "zaya": ({"num_experts_per_tok": 1}, "the config accepts num_experts_per_tok=1 only"),
    "qwen4_exp_text": (
        {
            "indexer_n_heads": 2,
            "indexer_kv_heads": 1,
            "indexer_head_dim": 16,
            "indexer_budget": 16,
            "indexer_compress_ratio": 4,
        },
        "the default leaves the sparse-attention indexer unset",
    ),
}
