"""Llama3 model flavors for graph_trainer (``MODULE=graph_trainer.llama3``).

Reuses torchtitan's Llama3 ``Transformer`` and flavors and registers one more (models are
built through :mod:`graph_trainer.model`, not from here):

* ``"1B"``: dim 2048, 16 layers, 32 heads, 8 KV heads, vocab 128256, FFN hidden 8192
  (``ffn_dim_multiplier=1.5``, ``multiple_of=256``), rope theta 500000 — the shape of
  Llama 3.2 1B, for single-GPU work.
"""

from torchtitan.models.llama3 import Transformer, TransformerModelArgs, llama3_args

if "1B" not in llama3_args:
    llama3_args["1B"] = TransformerModelArgs(
        dim=2048,
        n_layers=16,
        n_heads=32,
        n_kv_heads=8,
        vocab_size=128256,
        ffn_dim_multiplier=1.5,
        multiple_of=256,
        rope_theta=500000,
    )

__all__ = ["Transformer", "TransformerModelArgs", "llama3_args"]
