"""Model building: flavor arguments, tokenizer, the Llama3 model, its loss, its block layout; the one
builder of training, the dry run, the scripts and the tests."""

import copy
from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.distributed._functional_collectives as funcol
from torchtitan.components.tokenizer import HuggingFaceTokenizer

from graph_trainer import data
from graph_trainer.errors import UserError
from graph_trainer.llama3 import Transformer, llama3_args

#: The vocabulary size of the embedded tokenizer (graph_trainer.data).
EMBEDDED_VOCAB_SIZE = 2048


def loss_fn(logits: torch.Tensor, labels: torch.Tensor, dp_group: Any = None) -> torch.Tensor:
    """This rank's share of the global batch's mean token cross-entropy, as torchtitan's Trainer computes it: the sum
    over this rank's tokens / the valid tokens of the global batch, so gradients summed over the data-parallel ranks
    are the global mean's. ``logits``: ``[B, S, V]``, any float dtype (upcast to fp32; a DTensor under TP loss
    parallel); ``labels``: ``[B, S]`` int64, ``-100`` ignored; ``dp_group``: the data-parallel ranks (ProcessGroup
    or 1-D DeviceMesh) or None. Returns a 0-d fp32 tensor (a replicated DTensor under loss parallel)."""
    loss_sum = torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(0, 1), ignore_index=-100,
                                                 reduction="sum")
    valid = (labels != -100).sum()
    if dp_group is not None:
        valid = funcol.all_reduce(valid, "sum", dp_group)  # waited on at its first use
    return loss_sum / valid


def flavors() -> dict[str, Any]:
    """``{flavor name: TransformerModelArgs}`` (torchtitan's Llama3 flavors and ``"1B"``)."""
    return llama3_args


def model_args(flavor: str, **overrides: Any):
    """A copy of ``flavor``'s ``TransformerModelArgs`` with ``overrides`` applied (e.g. ``n_layers=2``). Raises
    UserError: unknown flavor. TypeError: an override names no field."""
    if flavor not in flavors():
        raise UserError(f"Unknown --model.flavor '{flavor}'. Valid values: {', '.join(sorted(flavors()))}.")
    return replace(copy.deepcopy(flavors()[flavor]), **overrides)


def build_tokenizer(cfg):
    """torchtitan's ``HuggingFaceTokenizer`` from ``--model.hf_assets_path`` or the embedded one. Raises UserError:
    the folder holds no tokenizer (:func:`graph_trainer.data.resolve_tokenizer_path`)."""
    return HuggingFaceTokenizer(data.resolve_tokenizer_path(cfg.model.hf_assets_path, EMBEDDED_VOCAB_SIZE))


def build_model_args(cfg, tokenizer):
    """A copy of the flavor's ``TransformerModelArgs``, ``update_from_config``'d; the flavor's vocab size is kept (the
    8B keeps 128256 whatever the tokenizer). Raises UserError: unknown flavor; the tokenizer has more tokens than the
    model embeds."""
    args = model_args(cfg.model.flavor)
    args.update_from_config(cfg)
    if tokenizer.get_vocab_size() > args.vocab_size:
        raise UserError(f"The tokenizer has {tokenizer.get_vocab_size()} tokens but flavor '{cfg.model.flavor}' "
                        f"embeds {args.vocab_size}. Use a matching --model.hf_assets_path.")
    return args


def build_model(args, device: torch.device | str = "cpu", *, seed: int | None = None, init: bool = True):
    """torchtitan's Llama3 ``Transformer(args)`` on ``device`` (``"meta"``: nothing allocated), in
    train mode; ``torch.manual_seed(seed)`` first when given; ``init``: run ``init_weights`` (not on meta)."""
    device = torch.device(device)
    if seed is not None:
        torch.manual_seed(seed)
    with torch.device(device):
        model = Transformer(args)
    if init and device.type != "meta":
        with torch.no_grad():
            model.init_weights(buffer_device=device)
    return model.train()


@dataclass(frozen=True)
class BlockLayout:
    """How trainable parameters fall into transformer blocks, in forward order: ``params_before``
    the first block (Llama3: the embedding), ``params_per_block`` (Llama3: 9) and ``n_blocks``."""

    params_before: int
    params_per_block: int
    n_blocks: int

    def params_of_first_blocks(self, n: int) -> int:
        """Parameters in forward order up to the end of block ``n`` (``0..n_blocks``), those before included."""
        return self.params_before + self.params_per_block * n


def block_layout(model: torch.nn.Module) -> BlockLayout:
    """The :class:`BlockLayout` of a Llama3 ``Transformer`` (also on meta, after TP / AC wrapping)."""

    def count(module):
        return sum(p.requires_grad for p in module.parameters())

    layers = list(model.layers.values()) if hasattr(model.layers, "values") else list(model.layers)
    return BlockLayout(count(model.tok_embeddings), count(layers[0]) if layers else 0, len(layers))
