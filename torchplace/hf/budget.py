"""accelerate's ``max_memory`` as a torchplace :class:`Cluster`, and the KV cache of a batch.

accelerate names devices ``0, 1, ...`` (GPU ids), ``"cpu"`` and ``"disk"``; torchplace names them
``"cuda:0"``, ``"cuda:1"``, ``"cpu"`` and ``"disk"`` and converts back in the map it returns. Under
:func:`accelerate.dispatch_model` a module mapped to ``"cpu"`` (when a GPU is in the map) or to
``"disk"`` does not compute there: its weights are streamed to the *main device*
(:func:`main_device`: the lowest GPU id, else the CPU) before each call. Those devices therefore
get kinds ``"cpu-offload"`` / ``"disk-offload"`` whose time per block is the main device's time
plus the block's weight bytes over the host link (the cluster's ``bandwidth``) or the disk
(``disk_bandwidth``), and whose activations move as the main device's do (:func:`hf_cluster`'s
links): one cost model, with the times the runtime really pays put on the graph
(:func:`offload_times`).
"""
from __future__ import annotations

import math
import re
from collections.abc import Mapping
from dataclasses import replace
from typing import Any

from torchplace import machine
from torchplace.checks import brief
from torchplace.devices import DEFAULT_LINK_BANDWIDTH, Cluster, Device, Link
from torchplace.errors import UsageError
from torchplace.graph import NodeRecord, OpGraph
from torchplace.units import parse_memory

__all__ = ["DISK_BANDWIDTH", "OFFLOAD_KINDS", "accelerate_name", "hf_cluster", "kv_cache_bytes", "main_device",
           "offload_times"]

OFFLOAD_KINDS = ("cpu-offload", "disk-offload")
"""Kinds of devices that only store weights: their blocks compute on the main device."""

DISK_BANDWIDTH = 2e9
"""Bytes/s read from an offload folder (an NVMe SSD); ``disk_bandwidth=`` overrides it."""

_GPU = re.compile(r"(?:cuda:)?(0|[1-9][0-9]*)")


def _key(key: Any) -> str:
    """torchplace's name of an accelerate ``max_memory`` key: ``0`` / ``"0"`` / ``"cuda:0"`` -> ``"cuda:0"``."""
    if isinstance(key, bool):
        raise UsageError(f"max_memory keys are GPU ids, 'cpu' or 'disk', got {key!r}")
    if isinstance(key, int) and key >= 0:
        return f"cuda:{key}"
    if isinstance(key, str):
        if key in ("cpu", "disk"):
            return key
        m = _GPU.fullmatch(key.strip())
        if m:
            return f"cuda:{m.group(1)}"
    raise UsageError(f"max_memory keys are GPU ids (0, 1, ... or 'cuda:0'), 'cpu' or 'disk', got {brief(key)}")


def accelerate_name(device: str) -> int | str:
    """accelerate's name of a torchplace device: ``"cuda:1"`` -> ``1``; ``"cpu"``, ``"disk"`` as they are."""
    return int(device.split(":")[1]) if device.startswith("cuda:") else device


def _budgets(max_memory: Mapping[Any, int | str] | None, cluster: Cluster | None = None) -> dict[str, int]:
    """torchplace device name -> bytes, GPUs in id order, then cpu, then disk."""
    if max_memory is None and cluster is not None:
        max_memory = {d.name: d.memory_bytes for d in cluster.devices
                      if d.memory_bytes is not None and (d.name in ("cpu", "disk") or _GPU.fullmatch(d.name))}
    if max_memory is None:
        caps = {f"cuda:{i}": machine.cuda_memory(i) for i in range(machine.cuda_count())}
        caps["cpu"] = machine.cpu_memory()
        return caps
    if not isinstance(max_memory, Mapping) or not max_memory:
        raise UsageError(f"max_memory must be a non-empty dict like {{0: '10GiB', 'cpu': '30GiB'}}, "
                         f"got {brief(max_memory)}")
    caps = {}
    for key, value in max_memory.items():
        name = _key(key)
        if name in caps:
            raise UsageError(f"max_memory names device {name!r} twice")
        try:
            caps[name] = parse_memory(value)
        except UsageError as e:
            raise UsageError(f"max_memory[{key!r}]: {e}") from None
    gpus = sorted((n for n in caps if n.startswith("cuda:")), key=lambda n: int(n.split(":")[1]))
    return {n: caps[n] for n in [*gpus, *(k for k in ("cpu", "disk") if k in caps)]}


def _gpu_kinds(cluster: Cluster | None, gpus: list[str]) -> dict[str, str]:
    """The kind of each GPU: the cluster device of that name (or the i-th non-CPU one), else "cuda"."""
    if cluster is None:
        return dict.fromkeys(gpus, "cuda")
    accel = [d for d in cluster.devices if d.kind != "cpu"]
    out = {}
    for i, name in enumerate(gpus):
        named = [d for d in cluster.devices if d.name in (name, name.split(":")[1])]
        if named:
            out[name] = named[0].kind
        elif i < len(accel):
            out[name] = accel[i].kind
        else:
            raise UsageError(f"the cluster file describes {len(accel)} accelerator(s) but max_memory names "
                             f"{name!r}: describe every GPU of max_memory in the cluster file")
    return out


def hf_cluster(max_memory: Mapping[Any, int | str] | None, cluster: Cluster | None = None) -> Cluster:
    """The cluster accelerate's ``max_memory`` describes (module docstring), kinds from ``cluster``.

    Args:
        max_memory: ``{0: "10GiB", 1: "10GiB", "cpu": "30GiB", "disk": "1TiB"}``; ``None``: the
            memory of ``cluster``'s devices named ``cuda:i`` / ``cpu`` / ``disk``, else every
            visible GPU and the CPU with their memory (no disk).
        cluster: a cluster (e.g. from a cluster file) giving each GPU's kind (by name ``"cuda:i"``
            or ``"i"``, else the i-th non-CPU device), the default link and the links between
            devices of those names. Offload devices get the links their blocks' activations really
            take (:func:`_offload_links`), whatever the cluster says of ``"cpu"`` and ``"disk"``.

    Raises:
        UsageError: a bad key or amount (named), or GPUs the cluster does not describe.
    """
    caps = _budgets(max_memory, cluster)
    gpus = [n for n in caps if n.startswith("cuda:")]
    kinds = _gpu_kinds(cluster, gpus)
    devices = [Device(n, n, kinds[n], caps[n]) for n in gpus]
    if "cpu" in caps:
        devices.append(Device("cpu", "cpu", "cpu-offload" if gpus else "cpu", caps["cpu"]))
    if "disk" in caps:
        devices.append(Device("disk", "cpu", "disk-offload", caps["disk"]))
    if cluster is None:
        return _offload_links(Cluster(tuple(devices)))
    names = {d.name for d in devices}
    links = {pair: link for pair, link in cluster.links.items() if set(pair) <= names}
    pairs = {pair: bw for pair, bw in cluster.pair_bandwidth.items() if set(pair) <= names}
    return _offload_links(Cluster(tuple(devices), bandwidth=cluster.bandwidth, latency=cluster.latency,
                                  links=links, pair_bandwidth=pairs))


def main_device(cluster: Cluster) -> str | None:
    """The device that computes the blocks mapped to ``"cpu"`` / ``"disk"``: the cluster's first device
    that computes (:func:`hf_cluster` lists GPUs in id order, so the lowest GPU id of ``max_memory``;
    the CPU without a GPU); ``None`` when only ``"disk"`` is given (accelerate then computes on the CPU).

    accelerate 1.15's ``dispatch_model`` (and ``from_pretrained``, which calls it without
    ``main_device``) picks ``list(set(device_map.values()) - {"cpu", "disk"})[0]``. That set of ints
    is built afresh, and an int hashes to itself, so CPython iterates it in ascending order when
    every id has its own slot: ids below 8 when the map names at most four GPUs, below 32 when it
    names five to nine (checked over every hash seed tried). So accelerate picks the lowest GPU id
    the map names, and :func:`torchplace.hf.maps.to_device_map` names this device in every map that
    offloads. (Beyond that its pick follows CPython's set layout, not the lowest id: pass
    ``main_device=`` to ``dispatch_model`` there.)
    """
    return next((d.name for d in cluster.devices if d.kind not in OFFLOAD_KINDS), None)


def _offload_links(cluster: Cluster) -> Cluster:
    """``cluster`` with the links activations really take to and from offload devices.

    An offloaded block computes on the main device (:func:`main_device`, as in
    :func:`offload_times`), so its inputs and outputs never leave it: between the main device and
    an offload device, or two offload devices, nothing moves (an infinitely fast link); between
    an offload device and another GPU, they take that GPU's link with the main device. (Its
    weights' trip to the main device is in the block's time.)
    """
    main = main_device(cluster)
    offload = [d.name for d in cluster.devices if d.kind in OFFLOAD_KINDS]
    if not offload or main is None:
        return cluster
    free = Link(math.inf, 0.0)
    links = {pair: link for pair, link in cluster.links.items() if not set(pair) & set(offload)}
    pairs = {pair: bw for pair, bw in cluster.pair_bandwidth.items() if not set(pair) & set(offload)}
    for x in offload:
        for d in cluster.devices:
            if d.name == x:
                continue
            if d.name == main or d.name in offload:
                links[(x, d.name)] = links[(d.name, x)] = free
            else:
                links[(x, d.name)] = cluster.link(main, d.name)
                links[(d.name, x)] = cluster.link(d.name, main)
    return replace(cluster, links=links, pair_bandwidth=pairs)


def offload_times(graph: OpGraph, cluster: Cluster, disk_bandwidth: float = DISK_BANDWIDTH,
                  host_bandwidth: float | None = None) -> OpGraph:
    """``graph`` with times for the offload kinds of ``cluster``: the time on the kind of
    :func:`main_device` (the CPU's when it is ``None``) plus the block's weights over the host link
    (``"cpu-offload"``: ``host_bandwidth``, else the cluster's default link) or from disk
    (``"disk-offload"``)."""
    kinds = {d.kind for d in cluster.devices}
    name = main_device(cluster)
    main = "cpu" if name is None else cluster.device(name).kind
    host = host_bandwidth or cluster.bandwidth or DEFAULT_LINK_BANDWIDTH

    def offloaded(v: str, r: NodeRecord) -> NodeRecord:
        times = dict(r.times)
        if "cpu-offload" in kinds:
            times["cpu-offload"] = r.times[main] + r.param_bytes / host
        if "disk-offload" in kinds:
            times["disk-offload"] = r.times[main] + r.param_bytes / disk_bandwidth
        return replace(r, times=times)

    return graph.with_records(offloaded)


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
    """Outermost modules whose class name ends in "Attention" that keep a KV cache when generating:
    all of a decoder-only model's; only the decoder's of an encoder-decoder model."""
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


def _probed_elements(model: Any, config: Any) -> dict[int, int]:
    """Layer index -> key and value elements the model's own cache keeps per token of one sequence,
    read from a ``DynamicCache`` after a forward pass of one sequence of two tokens (on the meta
    device for a model built there): what the model's code caches, whatever it is. Multi-head latent
    attention (DeepSeek-V2/V3, MiniCPM3) caches its compressed latent in transformers 5
    (``kv_lora_rank + qk_rope_head_dim`` elements, one head) and every head's keys and values in
    4.x; no config field tells which. A pass that fails part-way (a mixture of experts does not run
    on the meta device) has filled the layers before it. Empty where nothing could be read."""
    import inspect
    import warnings

    import torch

    try:
        from transformers import DynamicCache

        cache = DynamicCache(config=config)
        parameters = inspect.signature(model.forward).parameters
    except (ImportError, TypeError, ValueError, AttributeError, KeyError):
        return {}
    if "input_ids" not in parameters or getattr(model.config, "is_encoder_decoder", False):
        return {}
    weight = next(iter(model.parameters()), None)
    ids = torch.zeros(1, 2, dtype=torch.long, device=weight.device if weight is not None else "cpu")
    kwargs: dict[str, Any] = {"input_ids": ids, "use_cache": True,
                              ("cache" if "cache" in parameters else "past_key_values"): cache}
    if "logits_to_keep" in parameters:
        kwargs["logits_to_keep"] = 1
    try:
        with torch.no_grad(), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            model(**kwargs)
    except Exception:  # noqa: BLE001 - the layers filled before the failure are read below
        pass
    out = {}
    for i, layer in enumerate(getattr(cache, "layers", ())):
        keys, values = getattr(layer, "keys", None), getattr(layer, "values", None)
        if isinstance(keys, torch.Tensor) and isinstance(values, torch.Tensor) and keys.dim() == 4 \
                and keys.shape[-2] == 2 and values.shape[-2] == 2:
            out[i] = (keys.numel() + values.numel()) // 2
    return out


def kv_cache_bytes(model: Any, block_paths: list[str], batch_size: int, sequence_length: int,
                   itemsize: int) -> dict[str, int]:
    """Bytes of the KV cache each block holds while generating ``batch_size`` sequences of
    ``sequence_length`` tokens: ``batch x seq x elements x itemsize`` per attention layer, with the
    elements per token the model's own cache keeps (:func:`_probed_elements`; a layer the probe did
    not reach takes those of the first reached layer of its class, and where it reached none,
    ``2 x kv_heads x head_dim`` from the config), ``seq`` at most ``window - 1`` on a
    sliding-window layer (:func:`_windows`), on the
    block that holds that layer (:func:`_cache_holders`; split evenly between its key
    and value projections when the attention module is split). Empty for models that do not generate.

    Args:
        block_paths: module paths of the blocks that hold a whole module (not ``"<direct>"``
            blocks, which hold only their module's own tensors: the root's ``""`` would hold every
            layer's cache).
    """
    can = getattr(model, "can_generate", None)
    if not (callable(can) and can()):
        return {}
    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    kv, dim = _heads(config)
    windows = {} if getattr(model.config, "is_encoder_decoder", False) else _windows(config)
    probed = _probed_elements(model, config)
    modules = dict(model.named_modules())
    attentions = _attention_paths(model)
    layers = {att: getattr(modules[att], "layer_idx", i) for i, att in enumerate(attentions)}
    of_class: dict[type, int] = {}
    for att in attentions:
        if layers[att] in probed:
            of_class.setdefault(type(modules[att]), probed[layers[att]])
    out: dict[str, int] = {}
    for att in attentions:
        layer = layers[att]
        elements = probed.get(layer, of_class.get(type(modules[att]), 2 * kv * dim))
        window = windows.get(layer)
        per_layer = batch_size * elements * itemsize * (
            sequence_length if window is None else min(sequence_length, window - 1))
        holders = _cache_holders(att, block_paths)
        for i, p in enumerate(holders):
            share = per_layer // len(holders) + (per_layer % len(holders) if i == 0 else 0)
            out[p] = out.get(p, 0) + share
    return out
