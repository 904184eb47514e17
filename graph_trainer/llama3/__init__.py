"""Llama3 flavors (``MODULE=graph_trainer.llama3``): torchtitan's, plus ``"1B"``, the shape of
Llama 3.2 1B for single-GPU work. Models are built through :mod:`graph_trainer.model`."""

from torchtitan.models.llama3 import Transformer, TransformerModelArgs, llama3_args

if "1B" not in llama3_args:
    llama3_args["1B"] = TransformerModelArgs(dim=2048, n_layers=16, n_heads=32, n_kv_heads=8, vocab_size=128256,
                                             ffn_dim_multiplier=1.5, multiple_of=256, rope_theta=500000)

__all__ = ["Transformer", "TransformerModelArgs", "llama3_args"]
