"""The models ``plan`` partitions: shape specs of well-known models, by formula (no download, no
memory), in their reference implementation's ``named_parameters()`` order, tied weights once, as
a partition sees them; or any ``module:function``, built on the meta device.
"""

from __future__ import annotations

import importlib
import inspect
import math
import os
import sys
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from torch import nn

Shape = tuple[int, ...]


def numels(shapes: Sequence[Shape]) -> list[int]:
    """The number of elements of each shape.

    Example:
        >>> numels([(3, 4), (5,), ()]), total_numel([(3, 4), (5,)])
        ([12, 5, 1], 17)
    """
    return [math.prod(s) for s in shapes]


def total_numel(shapes: Sequence[Shape]) -> int:
    """The number of parameters of a whole model."""
    return sum(numels(shapes))


def gpt2_shapes(
    n_layer: int, n_embd: int, vocab_size: int = 50257, n_positions: int = 1024
) -> list[Shape]:
    """GPT-2 (``transformers.GPT2LMHeadModel``; the LM head is tied to the token embedding).

    Example:
        >>> total_numel(gpt2_shapes(24, 1024))  # GPT-2 medium
        354823168
    """
    d = n_embd
    block: list[Shape] = [
        (d,), (d,), (d, 3 * d), (3 * d,),  # ln_1, attn.c_attn (Conv1D: in x out)
        (d, d), (d,), (d,), (d,),  # attn.c_proj, ln_2
        (d, 4 * d), (4 * d,), (4 * d, d), (d,),  # mlp.c_fc, mlp.c_proj
    ]  # fmt: skip
    return [(vocab_size, d), (n_positions, d), *block * n_layer, (d,), (d,)]


def bert_shapes(
    n_layer: int = 12,
    hidden: int = 768,
    vocab_size: int = 30522,
    max_positions: int = 512,
    type_vocab_size: int = 2,
) -> list[Shape]:
    """BERT (``transformers.BertModel``, with the pooler), base size by default.

    Example:
        >>> total_numel(bert_shapes())  # bert-base-uncased
        109482240
    """
    h, ff = hidden, 4 * hidden
    embeddings: list[Shape] = [
        (vocab_size, h), (max_positions, h), (type_vocab_size, h),  # word, position, token type
        (h,), (h,),  # LayerNorm
    ]  # fmt: skip
    layer: list[Shape] = [
        (h, h), (h,), (h, h), (h,), (h, h), (h,),  # attention.self: query, key, value
        (h, h), (h,), (h,), (h,),  # attention.output: dense, LayerNorm
        (ff, h), (ff,),  # intermediate.dense
        (h, ff), (h,), (h,), (h,),  # output: dense, LayerNorm
    ]  # fmt: skip
    return [*embeddings, *layer * n_layer, (h, h), (h,)]


def resnet_shapes(
    layers: Sequence[int] = (3, 4, 6, 3), num_classes: int = 1000, expansion: int = 4
) -> list[Shape]:
    """A bottleneck ResNet (``torchvision.models.resnet50`` by default); batch norm has 2 params.

    Example:
        >>> total_numel(resnet_shapes())  # ResNet-50
        25557032
        >>> total_numel(resnet_shapes((3, 4, 23, 3)))  # ResNet-101
        44549160
    """
    shapes: list[Shape] = [(64, 3, 7, 7), (64,), (64,)]
    inplanes = 64
    for stage, blocks in enumerate(layers):
        width = 64 * 2**stage
        out = width * expansion
        for b in range(blocks):
            shapes += [(width, inplanes, 1, 1), (width,), (width,)]
            shapes += [(width, width, 3, 3), (width,), (width,)]
            shapes += [(out, width, 1, 1), (out,), (out,)]
            if b == 0:  # downsample: 1x1 conv and batch norm
                shapes += [(out, inplanes, 1, 1), (out,), (out,)]
            inplanes = out
    return [*shapes, (num_classes, inplanes), (num_classes,)]


def llama_shapes(
    n_layer: int = 16,
    hidden: int = 2048,
    intermediate: int = 8192,
    n_heads: int = 32,
    n_kv_heads: int = 8,
    vocab_size: int = 128256,
    tie_embeddings: bool = True,
) -> list[Shape]:
    """A Llama-style decoder (``transformers.LlamaForCausalLM``), Llama-3.2-1B by default.

    Example:
        >>> total_numel(llama_shapes())  # Llama-3.2-1B
        1235814400
    """
    h, kv = hidden, hidden // n_heads * n_kv_heads
    layer: list[Shape] = [
        (h, h), (kv, h), (kv, h), (h, h),  # self_attn: q, k, v, o (no biases)
        (intermediate, h), (intermediate, h), (h, intermediate),  # mlp: gate, up, down
        (h,), (h,),  # input_layernorm, post_attention_layernorm (RMSNorm)
    ]  # fmt: skip
    head: list[Shape] = [] if tie_embeddings else [(vocab_size, h)]
    return [(vocab_size, h), *layer * n_layer, (h,), *head]


MODELS: dict[str, Callable[[], list[Shape]]] = {
    "gpt2-small": lambda: gpt2_shapes(12, 768),
    "gpt2-medium": lambda: gpt2_shapes(24, 1024),
    "bert-base": bert_shapes,
    "resnet50": resnet_shapes,
    "llama-1b": llama_shapes,
}
"""The built-in specs by name, as ``zero-functional plan NAME`` takes them."""

OUTSIDE_BLOCKS: dict[str, tuple[int, int]] = {
    "gpt2-small": (2, 2),  # wte, wpe | ln_f
    "gpt2-medium": (2, 2),
    "bert-base": (5, 2),  # embeddings: word, position, token type, LayerNorm | pooler
    "resnet50": (0, 2),  # (its convolutions are 4-D) | fc
    "llama-1b": (1, 1),  # embed_tokens | norm (the head is tied to embed_tokens)
}
"""Per built-in spec, how many of its parameters come before its repeated blocks and after
them: the embeddings, the head and the final norm, which Muon leaves to AdamW."""


def _build(target: str) -> nn.Module:
    import torch  # here: the command line answers --help without torch

    module_name, sep, func_name = target.partition(":")
    if not sep or not module_name or not func_name:
        raise ValueError(
            f"model {target!r} is neither a built-in ({', '.join(MODELS)}) nor module:function"
        )
    try:
        module = importlib.import_module(module_name)
    except Exception as e:  # not found, a syntax error, or an error while it imports
        why = f"cannot import {module_name!r} for model {target!r}: {_why(e, module_name)}"
        raise ValueError(why) from e
    factory = getattr(module, func_name, None)
    if not callable(factory):
        raise ValueError(f"{module_name!r} has no callable {func_name!r} (from model {target!r})")
    try:
        inspect.signature(factory).bind()
    except TypeError as e:
        raise ValueError(
            f"{target} needs arguments ({e}); plan calls it with none: point it at a function "
            "that builds the model without arguments"
        ) from e
    except ValueError:
        pass  # no signature to read (some builtins): find out by calling it
    try:
        with torch.device("meta"):
            model = factory()
    except Exception as e:
        raise ValueError(f"{target} raised {type(e).__name__}: {e}") from e
    if not isinstance(model, torch.nn.Module):
        raise ValueError(
            f"{target} returned {type(model).__name__}, not a torch.nn.Module; "
            "return the model itself"
        )
    return model


def _why(e: Exception, module_name: str) -> str:
    """Why a module did not import, with where to look when it (or its package) is not found."""
    if isinstance(e, SyntaxError):
        return f"syntax error in {e.filename}, line {e.lineno}: {e.msg}"
    if not isinstance(e, ImportError):
        return f"importing it raised {type(e).__name__}: {e}"
    missing = e.name if isinstance(e, ModuleNotFoundError) else None
    if missing is None or not (module_name == missing or module_name.startswith(missing + ".")):
        return str(e)  # the module was found, and something it imports is missing
    here = os.getcwd()
    on_path = any(os.path.abspath(p or os.curdir) == here for p in sys.path)
    searched = f" (the current directory {here} included)" if on_path else ""
    return (
        f"no module named {missing!r} on sys.path{searched}: run from the folder that holds it "
        "(zero-functional and python -m zero_functional look in the current directory), or "
        "add that folder to PYTHONPATH"
    )


def model_shapes(name: str) -> list[Shape]:
    """The shapes of a built-in spec (:data:`MODELS`), or of the ``nn.Module`` that
    ``module:function`` (no arguments) returns, built under ``torch.device("meta")``: shapes
    without storage, so a 7B model costs no memory.

    Example:
        >>> total_numel(model_shapes("bert-base")), model_shapes("torch.nn:Identity")
        (109482240, [])
        >>> model_shapes("torch.nn:Linear")  # a ValueError says what is wrong
        Traceback (most recent call last):
        ...
        ValueError: torch.nn:Linear needs arguments (missing a required argument: 'in_features'); plan calls it with none: point it at a function that builds the model without arguments
    """
    if name in MODELS:
        return MODELS[name]()
    return [tuple(p.shape) for p in _build(name).parameters()]


def muon_params(name: str) -> tuple[list[Shape], list[bool]]:
    """A model's shapes and, for each, whether Muon takes it: its hidden 2-D matrices (the
    recipe of ``MuonWithAuxAdam``; AdamW takes embeddings, the head, norms, biases). For a
    built-in spec, the 2-D parameters of its repeated blocks (:data:`OUTSIDE_BLOCKS`); for a
    ``module:function``, each 2-D parameter but an ``nn.Embedding``'s or ``EmbeddingBag``'s and
    those whose dotted name has a part that contains ``emb`` or ends in ``head``.

    Example:
        >>> shapes, muon = muon_params("gpt2-small")
        >>> sum(muon), [s for s, m in zip(shapes, muon) if m][:4]
        (48, [(768, 2304), (768, 768), (768, 3072), (3072, 768)])
        >>> muon_params("torch.nn:Transformer")[1].count(True)  # 6 layers of 4, 6 of 6
        60
    """
    if name in MODELS:
        shapes = MODELS[name]()
        before, after = OUTSIDE_BLOCKS[name]
        inside = range(before, len(shapes) - after)
        return shapes, [len(s) == 2 and i in inside for i, s in enumerate(shapes)]
    import torch

    model = _build(name)
    embedding = (torch.nn.Embedding, torch.nn.EmbeddingBag)
    tables = [p for m in model.modules() if isinstance(m, embedding) for p in m.parameters()]
    named = list(model.named_parameters())

    def hidden(param_name: str, p: torch.Tensor) -> bool:
        outside = any("emb" in part or part.endswith("head") for part in param_name.split("."))
        return p.ndim == 2 and not outside and not any(p is t for t in tables)

    return [tuple(p.shape) for _, p in named], [hidden(n, p) for n, p in named]
