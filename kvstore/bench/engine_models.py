"""Tiny models with seeded random weights, written by `transformers` at run time (no download),
for the engine benchmark and the engine tests. `initializer_range` 0.2: smaller values make a
random model repeat one token; 0.2 gives varied output."""

from __future__ import annotations

from pathlib import Path
from typing import Any

TINY_VOCAB = 2048


def write_llama(path: Path, seed: int, max_positions: int = 32768) -> Path:
    """A 2-layer Llama (2 KV heads of 32): 512 bytes of KV per token in bf16."""
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=TINY_VOCAB, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=max_positions,
                      initializer_range=0.2, torch_dtype="bfloat16")
    AutoModelForCausalLM.from_config(cfg).to(torch.bfloat16).save_pretrained(path)
    return path


def write_gemma3(path: Path, seed: int, sliding_window: int, **extra: Any) -> Path:
    """A 4-layer Gemma-3-style text model: sliding-window layers beside full-attention ones."""
    import torch
    from transformers import AutoModelForCausalLM, Gemma3TextConfig

    torch.manual_seed(seed)
    cfg = Gemma3TextConfig(
        vocab_size=TINY_VOCAB, hidden_size=128, intermediate_size=256, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, head_dim=32, max_position_embeddings=32768, initializer_range=0.2,
        sliding_window=sliding_window, layer_types=["sliding_attention", "full_attention"] * 2,
        torch_dtype="bfloat16", **extra)
    AutoModelForCausalLM.from_config(cfg).to(torch.bfloat16).save_pretrained(path)
    return path


def write_deepseek_v2(path: Path, seed: int) -> Path:
    """A 2-layer DeepSeek-V2-style model: multi-head latent attention (one latent of 512 and a
    rotary key of 64 per token and layer: 2,304 bytes of KV per token in bf16) and a small
    mixture of experts in its layers. vLLM on CPU runs its latent attention with blocks of 16
    tokens, so kvstore's chunks of 128 are 8 of vLLM's blocks (as on a GPU)."""
    import torch
    from transformers import AutoModelForCausalLM, DeepseekV2Config

    torch.manual_seed(seed)
    cfg = DeepseekV2Config(
        vocab_size=TINY_VOCAB, hidden_size=256, intermediate_size=512, moe_intermediate_size=128,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4, n_routed_experts=4, n_shared_experts=1,
        num_experts_per_tok=2, n_group=1, topk_group=1, first_k_dense_replace=1, q_lora_rank=None,
        kv_lora_rank=512, qk_rope_head_dim=64, qk_nope_head_dim=32, v_head_dim=32,  # vLLM's CPU kernel: 576
        max_position_embeddings=32768, initializer_range=0.2, torch_dtype="bfloat16")
    AutoModelForCausalLM.from_config(cfg).to(torch.bfloat16).save_pretrained(path)
    return path
