"""Small models of other mlx-lm architectures, with random weights, written as a user's
Hugging Face folder would be (config.json, model.safetensors, the tiny demo model's
tokenizer): for checking the engine's own paths against more than the llama demo models."""

from __future__ import annotations

import importlib
import json
import shutil
from pathlib import Path
from typing import Any

import mlx.core as mx
from mlx.utils import tree_flatten, tree_unflatten

from engine.demo_models import ensure_demo

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "generation_config.json")
# The tiny demo model's vocabulary and special ids, which its tokenizer files name.
BASE_CONFIG = {"vocab_size": 1024, "bos_token_id": 1, "eos_token_id": [2, 4],
               "pad_token_id": 0, "max_position_embeddings": 4096}

# Multi-head latent attention: the values' head size (16) is not the queries' (16 + 8).
MINICPM3 = {"model_type": "minicpm3", "hidden_size": 64, "dim_model_base": 32,
            "num_hidden_layers": 2, "intermediate_size": 128, "num_attention_heads": 4,
            "num_key_value_heads": 4, "rms_norm_eps": 1e-5, "q_lora_rank": 32,
            "qk_nope_head_dim": 16, "qk_rope_head_dim": 8, "kv_lora_rank": 32,
            "scale_depth": 1.4, "scale_emb": 4.0, "rope_theta": 10000.0,
            "tie_word_embeddings": False,
            "rope_scaling": {"type": "longrope", "short_factor": [1.0] * 4,
                             "long_factor": [1.0] * 4,
                             "original_max_position_embeddings": 4096}}

# Mixture of experts: four experts, two a token.
MIXTRAL = {"model_type": "mixtral", "hidden_size": 64, "intermediate_size": 128,
           "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
           "num_local_experts": 4, "num_experts_per_tok": 2, "rms_norm_eps": 1e-5,
           "rope_theta": 10000.0}

# Grouped-query attention in gemma2's own code: four query heads over two key heads.
GEMMA2 = {"model_type": "gemma2", "hidden_size": 128, "num_hidden_layers": 3,
          "intermediate_size": 256, "num_attention_heads": 4, "num_key_value_heads": 2,
          "head_dim": 32, "query_pre_attn_scalar": 32, "rms_norm_eps": 1e-5,
          "tie_word_embeddings": True}

# Sliding-window layers (mlx-lm's RotatingKVCache) every other layer, heads of 32.
GEMMA3_TEXT = {"model_type": "gemma3_text", "hidden_size": 128, "num_hidden_layers": 3,
               "intermediate_size": 256, "num_attention_heads": 4, "num_key_value_heads": 2,
               "head_dim": 32, "query_pre_attn_scalar": 32, "rms_norm_eps": 1e-6,
               "rope_theta": 10000.0, "rope_local_base_freq": 10000.0, "sliding_window": 16,
               "sliding_window_pattern": 2}


def write_random_model(folder: Path, config: dict[str, Any], dtype: mx.Dtype,
                       seed: int = 0, scale: float = 0.1) -> Path:
    """A model of `config`'s architecture in `folder`: its weights normal * `scale`
    (norms as the architecture initialises them), stored in `dtype`."""
    config = {**BASE_CONFIG, **config,
              "torch_dtype": {mx.float32: "float32", mx.bfloat16: "bfloat16",
                              mx.float16: "float16"}[dtype]}
    arch = importlib.import_module(f"mlx_lm.models.{config['model_type']}")
    mx.random.seed(seed)
    model = arch.Model(arch.ModelArgs.from_dict(config))
    weights = [(name, w if "norm" in name or not mx.issubdtype(w.dtype, mx.floating)
                else mx.random.normal(w.shape) * scale)
               for name, w in tree_flatten(model.parameters())]
    model.update(tree_unflatten(weights))
    model.set_dtype(dtype)
    mx.eval(model.parameters())
    folder.mkdir(parents=True, exist_ok=True)
    demo = Path(ensure_demo("tiny"))
    for name in TOKENIZER_FILES:
        shutil.copy(demo / name, folder / name)
    mx.save_safetensors(str(folder / "model.safetensors"), dict(tree_flatten(model.parameters())))
    (folder / "config.json").write_text(json.dumps(config))
    return folder
