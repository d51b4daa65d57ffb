"""The KV cache a Hugging Face model keeps while it generates, and the blocks that hold it.

A decoder's self-attention layer keeps the keys and values of every token read or generated: its
cache grows with the sequence. An encoder-decoder model's cross-attention layer keeps the keys and
values of the encoder's output, made at the first step and kept to the end: its size is fixed by
the encoder's input (Whisper's 1500 audio frames, whatever the number of tokens generated). What
each attention module keeps is read from the model's own cache after one short forward pass
(:func:`_probe`), so a new attention variant is sized as its code caches, not as its config
suggests.
"""
from __future__ import annotations

import inspect
import re
import warnings
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from torchplace.errors import UsageError
from torchplace.hf.blocks import forward

__all__ = ["CacheShape", "kv_cache_bytes"]

_PROBE_TOKENS = 2
"""Decoder tokens of the probe's forward pass: per-token elements are its cache over this."""


@dataclass(frozen=True)
class CacheShape:
    """Key and value elements one attention module caches for one sequence: ``per_token`` for
    each token of the sequence (self-attention), ``fixed`` once (cross-attention's keys and values
    of the encoder's output)."""

    per_token: int
    fixed: int = 0


def _heads(config: Any) -> tuple[int, int]:
    """(key/value heads the cache keeps, head dim) of a transformer config: ``num_key_value_heads``
    (``num_kv_heads``), one for multi-query attention (``multi_query``), every head for Falcon's
    ``new_decoder_architecture`` (``FalconAttention`` caches its keys broadcast to all heads)."""
    heads = (getattr(config, "num_attention_heads", None) or getattr(config, "n_head", None)
             or getattr(config, "num_heads", None))
    if not heads:
        raise UsageError(f"cannot size the KV cache: {type(config).__name__} names no attention heads "
                         "(num_attention_heads / n_head / num_heads): if it keeps no KV cache, pass kv_cache=False "
                         "(torchplace plan --hf: --no-kv-cache)")
    if getattr(config, "new_decoder_architecture", False):  # Falcon-40B's: keys broadcast to every head, then cached
        kv = heads
    elif getattr(config, "multi_query", False):  # Falcon-7B, GPTBigCode: one key/value head
        kv = 1
    else:
        kv = getattr(config, "num_key_value_heads", None) or getattr(config, "num_kv_heads", None) or heads
    hidden = getattr(config, "hidden_size", None) or getattr(config, "n_embd", None) or getattr(config, "d_model", 0)
    dim = getattr(config, "head_dim", None) or getattr(config, "d_kv", None) or hidden // heads
    return int(kv), int(dim)


def _attention_paths(model: Any) -> list[str]:
    """Outermost modules whose class name ends in "Attention" that may keep a KV cache when
    generating: all of a decoder-only model's; only the decoder's of an encoder-decoder model."""
    config = getattr(model, "config", None)
    encdec = bool(getattr(config, "is_encoder_decoder", False))
    found: list[str] = []
    for name, m in model.named_modules():
        if not type(m).__name__.endswith("Attention") or any(name.startswith(f"{p}.") for p in found):
            continue
        if encdec and ".decoder." not in f".{name}.":
            continue
        found.append(name)
    return found


_KV_PROJECTION = re.compile(r"(?:k|v|key|value|kv)(?:_proj|_lin)?")
"""Last name of a module that makes an attention layer's keys or values (``k_proj``, ``v_proj``,
T5's ``k`` / ``v``, BERT's ``key`` / ``value``): under accelerate its output, which the cache keeps,
is made on that module's device."""


def _cache_holders(attention: str, block_paths: list[str]) -> list[str]:
    """The blocks an attention layer's cache is made on: the innermost block holding the whole
    attention module; when no block holds it (``no_split_module_classes`` splits it), the blocks
    inside it that make its keys and values (:data:`_KV_PROJECTION`), else the first block inside it
    (a fused query-key-value projection, GPT-2's ``c_attn``)."""
    outer = [p for p in block_paths if p == "" or attention == p or attention.startswith(f"{p}.")]
    if outer:
        return [max(outer, key=len)]
    inner = [p for p in block_paths if p.startswith(f"{attention}.")]
    made = [p for p in inner if _KV_PROJECTION.fullmatch(p.rpartition(".")[2])]
    return made or inner[:1]


def _windows(config: Any) -> dict[int, int]:
    """Layer index -> sliding window of the layers whose cache keeps only the last ``window - 1``
    tokens, as transformers' own ``DynamicCache(config=config)`` builds them (Mistral's
    ``sliding_window``, Gemma 2's alternating ``layer_types``); empty where it cannot be built."""
    try:
        from transformers import DynamicCache

        layers = DynamicCache(config=config).layers
    except (ImportError, TypeError, ValueError, AttributeError, KeyError):
        return {}
    return {i: w for i, layer in enumerate(layers)
            if isinstance(w := getattr(layer, "sliding_window", None), int) and w > 0}


def _layer_tensors(cache: Any) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
    """Layer index -> keys and values, for each layer of a transformers cache that holds 4-d
    tensors (batch x heads x tokens x dim)."""
    out = {}
    for i, layer in enumerate(getattr(cache, "layers", ())):
        keys, values = getattr(layer, "keys", None), getattr(layer, "values", None)
        if isinstance(keys, torch.Tensor) and isinstance(values, torch.Tensor) and keys.dim() == 4:
            out[i] = (keys, values)
    return out


def _held(cache: Any) -> tuple[int, int]:
    """(self-attention, cross-attention) key and value elements ``cache`` holds."""
    def total(c: Any) -> int:
        return sum(k.numel() + v.numel() for k, v in _layer_tensors(c).values())

    cross = getattr(cache, "cross_attention_cache", None)
    if cross is None:
        return total(cache), 0
    return total(cache.self_attention_cache), total(cross)


def _probe_inputs(model: Any, example: Mapping[str, Any] | None, parameters: Mapping[str, Any],
                  device: torch.device) -> dict[str, Any] | None:
    """Inputs of the probe: one sequence of :data:`_PROBE_TOKENS` decoder tokens; for an
    encoder-decoder model, the encoder's inputs of ``example``'s first sequence (its cross-attention
    cache is as long as the encoder's output). None where no inputs can be made."""
    decoder_tokens = torch.zeros(1, _PROBE_TOKENS, dtype=torch.long, device=device)
    if not getattr(model.config, "is_encoder_decoder", False):
        return {"input_ids": decoder_tokens} if "input_ids" in parameters else None
    if not example or "decoder_input_ids" not in parameters:
        return None
    out: dict[str, Any] = {}
    for name, value in example.items():
        if name in ("use_cache", "logits_to_keep", "labels") or name.startswith("decoder_"):
            continue
        out[name] = value[:1] if isinstance(value, torch.Tensor) and value.dim() > 0 else value
    out["decoder_input_ids"] = decoder_tokens
    return out


def _probe(model: Any, config: Any, attentions: list[str], example: Mapping[str, Any] | None
           ) -> tuple[dict[str, CacheShape], dict[int, int], bool]:
    """What the model's own cache keeps, after one forward pass of one sequence (on fake tensors for
    a model on the meta device: :func:`~torchplace.hf.blocks.forward`): ``(by_module, by_layer,
    complete)``.

    - ``by_module``: attention module path -> its :class:`CacheShape`, from what the cache gained
      while that module ran (forward hooks); empty where the modules do not account for the whole
      cache (a model whose cache is filled elsewhere).
    - ``by_layer``: layer index -> self-attention elements per token, read from the cache's layers
      (the fallback where ``by_module`` is empty).
    - ``complete``: the pass ran to the end, so a module that gained nothing keeps nothing
      (BartForCausalLM's cross-attention, which runs only beside an encoder). A pass that fails
      part-way (a mixture of experts does not run on the meta device) has filled the layers before
      it.

    Multi-head latent attention (DeepSeek-V2/V3, MiniCPM3) caches its compressed latent in
    transformers 5 (``kv_lora_rank + qk_rope_head_dim`` elements, one head) and every head's keys
    and values in 4.x; no config field tells which, so only the probe can."""
    try:
        from transformers import DynamicCache

        parameters = inspect.signature(model.forward).parameters
        if getattr(model.config, "is_encoder_decoder", False):
            from transformers import EncoderDecoderCache

            cache = EncoderDecoderCache(DynamicCache(config=config), DynamicCache(config=config))
        else:
            cache = DynamicCache(config=config)
    except (ImportError, TypeError, ValueError, AttributeError, KeyError):
        return {}, {}, False
    weight = next(iter(model.parameters()), None)
    kwargs = _probe_inputs(model, example, parameters, weight.device if weight is not None else torch.device("cpu"))
    if kwargs is None:
        return {}, {}, False
    kwargs.update({"use_cache": True, ("cache" if "cache" in parameters else "past_key_values"): cache})
    if "logits_to_keep" in parameters:
        kwargs["logits_to_keep"] = 1
    modules = dict(model.named_modules())
    before: dict[str, tuple[int, int]] = {}
    gained: dict[str, tuple[int, int]] = {}

    def on_enter(path: str):
        def hook(module: Any, args: Any) -> None:
            before[path] = _held(cache)
        return hook

    def on_exit(path: str):
        def hook(module: Any, args: Any, output: Any) -> None:
            (s0, c0), (s1, c1) = before.pop(path), _held(cache)
            s, c = gained.get(path, (0, 0))
            gained[path] = (s + s1 - s0, c + c1 - c0)
        return hook

    handles = [h for p in attentions for h in (modules[p].register_forward_pre_hook(on_enter(p)),
                                               modules[p].register_forward_hook(on_exit(p)))]
    complete = True
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            forward(model, kwargs)
    except Exception:  # noqa: BLE001 - the layers filled before the failure are read below
        complete = False
    finally:
        for h in handles:
            h.remove()
    layers = _layer_tensors(cache.self_attention_cache if hasattr(cache, "self_attention_cache") else cache)
    by_layer = {i: (k.numel() + v.numel()) // _PROBE_TOKENS for i, (k, v) in layers.items()
                if k.shape[-2] == _PROBE_TOKENS and v.shape[-2] == _PROBE_TOKENS}
    whole = _held(cache)
    accounted = (sum(s for s, _ in gained.values()), sum(c for _, c in gained.values())) == whole
    if not (len(by_layer) == len(layers) and accounted and any(whole)):  # every layer holds the probe's tokens
        return {}, by_layer, False
    by_module = {p: CacheShape(s // _PROBE_TOKENS, c) for p, (s, c) in gained.items() if s or c}
    return by_module, by_layer, complete


def kv_cache_bytes(model: Any, block_paths: list[str], batch_size: int, sequence_length: int,
                   itemsize: int, example: Mapping[str, Any] | None = None) -> dict[str, int]:
    """Bytes of the KV cache each block holds while generating ``batch_size`` sequences of
    ``sequence_length`` tokens, on the block that holds each attention module
    (:func:`_cache_holders`; split evenly between its key and value projections when the attention
    module is split). Empty for models that do not generate.

    Per module and sequence: ``per_token x seq + fixed`` elements of ``itemsize`` bytes, as
    :func:`_probe` read them from the model's own cache; ``seq`` at most ``window - 1`` on a
    sliding-window layer (:func:`_windows`). A module the probe did not reach takes what the first
    reached module of its class keeps, and where none was reached, ``2 x kv_heads x head_dim`` per
    token from the config; where the probe ran to the end, a module that kept nothing keeps nothing.

    Args:
        block_paths: module paths of the blocks that hold a whole module (not ``"<direct>"``
            blocks, which hold only their module's own tensors: the root's ``""`` would hold every
            layer's cache).
        example: keyword inputs of the forward pass planned (an encoder-decoder model's encoder
            inputs fix the length of its cross-attention cache).
    """
    can = getattr(model, "can_generate", None)
    if not (callable(can) and can()):
        return {}
    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    kv, dim = _heads(config)
    windows = {} if getattr(model.config, "is_encoder_decoder", False) else _windows(config)
    modules = dict(model.named_modules())
    attentions = _attention_paths(model)
    by_module, by_layer, complete = _probe(model, config, attentions, example)
    layers = {att: getattr(modules[att], "layer_idx", i) for i, att in enumerate(attentions)}
    if not by_module:  # read by layer index
        by_module = {att: CacheShape(by_layer[layers[att]]) for att in attentions if layers[att] in by_layer}
    of_class: dict[type, CacheShape] = {}
    for att, shape in by_module.items():
        of_class.setdefault(type(modules[att]), shape)
    out: dict[str, int] = {}
    for att in attentions:
        shape = by_module.get(att)
        if shape is None:
            shape = CacheShape(0) if complete else of_class.get(type(modules[att]), CacheShape(2 * kv * dim))
        window = windows.get(layers[att])
        tokens = sequence_length if window is None else min(sequence_length, window - 1)
        per_layer = batch_size * itemsize * (shape.per_token * tokens + shape.fixed)
        if not per_layer:
            continue
        holders = _cache_holders(att, block_paths)
        for i, p in enumerate(holders):
            share = per_layer // len(holders) + (per_layer % len(holders) if i == 0 else 0)
            out[p] = out.get(p, 0) + share
    return out
