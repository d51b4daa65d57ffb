"""Hugging Face models: solved ``device_map`` s for accelerate and ``from_pretrained``.

    device_map = torchplace.infer_device_map(model, {0: "10GiB", 1: "10GiB", "cpu": "30GiB"},
                                             batch_size=8, sequence_length=1024)
    model = AutoModelForCausalLM.from_pretrained(name, device_map=device_map)

:mod:`.blocks` turns a model (real weights or the meta device) into a chain of blocks with
costs; :mod:`.budget` maps accelerate's ``max_memory`` onto a cluster; :mod:`.kvcache` sizes the KV cache;
:mod:`.infer` solves; :mod:`.maps` writes the map and prices any map. accelerate itself is needed only to dispatch the map
(``pip install torchplace[hf]``).
"""
from torchplace.hf.blocks import HF_DEVICE_SPECS
from torchplace.hf.infer import DeviceMapPlan, build_problem, infer_device_map, plan_device_map, solve_device_map
from torchplace.hf.maps import MapCost, evaluate_device_map

__all__ = [
    "HF_DEVICE_SPECS",
    "DeviceMapPlan",
    "MapCost",
    "build_problem",
    "evaluate_device_map",
    "infer_device_map",
    "plan_device_map",
    "solve_device_map",
]
