"""Model building: flavor arguments, tokenizer, the Llama3 model, its loss, its block layout.

The one builder used by training, the dry run, the scripts and the tests::

    args = model_args("debugmodel", n_layers=2)       # a copy of a flavor, fields overridden
    model = build_model(args, device="cpu", seed=0)   # Transformer, weights initialised, train()
    loss = loss_fn(model(tokens), labels)

Flavors are torchtitan's Llama3 ones plus ``"1B"`` (:mod:`graph_trainer.llama3`).
"""

from __future__ import annotations

import copy
import dataclasses
from dataclasses import dataclass
from typing import Any

import torch

from graph_trainer.errors import UserError

#: The vocabulary size of the embedded tokenizer (graph_trainer.data).
EMBEDDED_VOCAB_SIZE = 2048


def loss_fn(logits: torch.Tensor, labels: torch.Tensor, dp_group: Any = None) -> torch.Tensor:
    """This rank's share of the global-batch mean token cross-entropy, as torchtitan's Trainer
    computes it: the cross-entropy summed over this rank's tokens, divided by the number of
    valid tokens of the global batch (all data-parallel ranks). Summing the gradients over the
    data-parallel ranks (FSDP reduce-scatter / all-reduce with ``sum``) then gives the gradient
    of the global mean, however the valid tokens are spread over the ranks.

    Args:
        logits: ``[B, S, V]``, any float dtype (upcast to fp32); a DTensor under TP loss parallel.
        labels: ``[B, S]`` int64; ``-100`` is ignored.
        dp_group: the data-parallel ranks sharing the global batch (a ProcessGroup or 1-D
            DeviceMesh), or ``None`` for one rank. The valid-token count is summed over it with
            a functional all-reduce, so under tracing it is a node of the graph.

    Returns:
        A 0-d fp32 tensor (a replicated DTensor under loss parallel). With ``dp_group=None``
        it is the mean token cross-entropy of the batch.
    """
    loss_sum = torch.nn.functional.cross_entropy(
        logits.flatten(0, 1).float(), labels.flatten(0, 1), ignore_index=-100, reduction="sum"
    )
    valid = (labels != -100).sum()
    if dp_group is not None:
        import torch.distributed._functional_collectives as funcol

        valid = funcol.all_reduce(valid, "sum", dp_group)  # waited on at its first use
    return loss_sum / valid


def flavors() -> dict[str, Any]:
    """``{flavor name: TransformerModelArgs}`` (torchtitan's Llama3 flavors and ``"1B"``)."""
    from graph_trainer.llama3 import llama3_args

    return llama3_args


def model_args(flavor: str, **overrides: Any):
    """A copy of flavor ``flavor``'s ``TransformerModelArgs`` with ``overrides`` applied
    (e.g. ``n_layers=2, dim=32, vocab_size=64``).

    Raises:
        UserError: unknown flavor.
        TypeError: an override names no field of the arguments.
    """
    table = flavors()
    if flavor not in table:
        raise UserError(f"Unknown --model.flavor '{flavor}'. Valid values: {', '.join(sorted(table))}.")
    return dataclasses.replace(copy.deepcopy(table[flavor]), **overrides)


def build_tokenizer(cfg):
    """torchtitan's ``HuggingFaceTokenizer`` from ``--model.hf_assets_path``, or the
    embedded one (:func:`graph_trainer.data.resolve_tokenizer_path`).

    Raises:
        UserError: the folder holds no tokenizer (from ``resolve_tokenizer_path``).
    """
    from torchtitan.components.tokenizer import HuggingFaceTokenizer

    from graph_trainer import data

    path = data.resolve_tokenizer_path(cfg.model.hf_assets_path, vocab_size=EMBEDDED_VOCAB_SIZE)
    return HuggingFaceTokenizer(path)


def build_model_args(cfg, tokenizer):
    """The flavor's ``TransformerModelArgs`` (a copy), updated from the config
    (``update_from_config``: seq len, attention kind, ...). The flavor's vocab size is
    kept (the 8B keeps 128256 whatever the tokenizer).

    Raises:
        UserError: unknown flavor; the tokenizer has more tokens than the model embeds.
    """
    args = model_args(cfg.model.flavor)
    args.update_from_config(cfg)
    if tokenizer.get_vocab_size() > args.vocab_size:
        raise UserError(
            f"The tokenizer has {tokenizer.get_vocab_size()} tokens but flavor "
            f"'{cfg.model.flavor}' embeds {args.vocab_size}. Use a matching --model.hf_assets_path."
        )
    return args


def build_model(args, device: torch.device | str = "cpu", *, seed: int | None = None, init: bool = True):
    """torchtitan's Llama3 ``Transformer(args)`` on ``device``, in train mode.

    Args:
        args: ``TransformerModelArgs`` (:func:`model_args` / :func:`build_model_args`).
        device: where parameters are allocated; ``"meta"`` allocates nothing.
        seed: ``torch.manual_seed(seed)`` before building, when given.
        init: run ``init_weights`` (skipped on the meta device, where there is nothing
            to initialise).
    """
    from graph_trainer.llama3 import Transformer

    device = torch.device(device)
    if seed is not None:
        torch.manual_seed(seed)
    with torch.device(device):
        model = Transformer(args)
    if init and device.type != "meta":
        with torch.no_grad():
            model.init_weights(buffer_device=device)
    model.train()
    return model


@dataclass(frozen=True)
class BlockLayout:
    """How a model's trainable parameters fall into transformer blocks, in forward order.

    Attributes:
        params_before: parameters used before the first block (Llama3: the embedding).
        params_per_block: parameters of one block (Llama3: 4 attention projections,
            3 FFN projections, 2 norm weights).
        n_blocks: number of blocks.
    """

    params_before: int
    params_per_block: int
    n_blocks: int

    def params_of_first_blocks(self, n: int) -> int:
        """Parameters in forward order up to the end of block ``n`` (``n`` in
        ``[0, n_blocks]``), the ones before the first block included."""
        return self.params_before + self.params_per_block * n


def block_layout(model: torch.nn.Module) -> BlockLayout:
    """The :class:`BlockLayout` of a Llama3 ``Transformer`` (works on the meta device and
    after TP / AC wrapping: only parameter counts are read)."""

    def count(module):
        return sum(1 for p in module.parameters() if p.requires_grad)

    layers = list(model.layers.values()) if hasattr(model.layers, "values") else list(model.layers)
    return BlockLayout(count(model.tok_embeddings), count(layers[0]) if layers else 0, len(layers))


def block_layout_of_args(args) -> BlockLayout:
    """:func:`block_layout` of a model built from ``args`` on the meta device (no memory)."""
    return block_layout(build_model(args, "meta"))
