"""Memory fidelity (issue 17): each device's predicted memory beside the peak measured on the CPU.

Run:  HF_HUB_OFFLINE=1 python benchmarks/memory_fidelity.py [--models mlp resnet inception gpt2 bert] [--training]
      [--devices cuda:0,cpu --cap 0.5]

Each model is placed on one and on two logical CPUs (or on the ``--devices`` sets, comma-separated;
``--cap``: the first device holds at most that share of the parameter bytes), with 1 and 4
micro-batches, and called once
to warm up and once measured. The prediction is the cost model's
(:func:`torchplace.costmodel.device_memory_parts`): parameters and buffers, shared copies, and
the liveness peak of one micro-batch's activations. The measurement counts, inside each device's
worker thread, the bytes of tensor memory that thread's operators allocate and that is still
referenced (a ``TorchDispatchMode`` sees every operator's outputs; a storage is counted once
from its first tensor until the last Python tensor on it dies), and takes its peak over the call.
Parameters are the model's own tensors, counted exactly on both sides, so the table compares the
activations (the modelled part) and the totals. Kernel scratch memory that never becomes a
tensor (oneDNN workspaces) is not seen; received tensors are host memory shared with their
sender, as the model says for CPUs.

``--training``: each model placed with ``mode="training"`` (SGD: no optimizer state; 1F1B), one
``placed.step`` measured after a warm-up step, ``.grad`` cleared before each; the loss (a mean square
of the first output) is given to ``place`` too, so its memory is measured there. Predicted per
device: gradients + working memory of one micro-batch (the loss's on the outputs' device) + the
activations kept for backward of the micro-batches in flight
(:func:`torchplace.costmodel.memory_parts`); measured: the same
per-thread peak over the step (forward and backward actions of a worker run on its thread), which
includes the gradients it allocates.

On a CUDA device the CUDA caching allocator's own count is shown too: ``max_memory_allocated``
over the call minus ``memory_allocated`` before it (what the call added at its peak: activations,
gradients, kernel workspaces), beside the per-thread tensor count.
"""
from __future__ import annotations

import argparse
import os
import platform
from datetime import date
from typing import Any

import torch
from torch.utils import _pytree as pytree

import torchplace
from torchplace import costmodel
from torchplace.models import build
from torchplace.runtime import workers


def measured_peaks(placed: Any, call: tuple[tuple, dict], train: Any = None) -> dict[str, int]:
    """Per worker (device), the peak live bytes its thread allocated during one call (with
    ``train = (target, loss_fn)``, one training step)."""
    with workers.peak_live_bytes() as peaks:
        if train is not None:
            placed.zero_grad(set_to_none=True)
            placed.step(*call[0], target=train[0], loss_fn=train[1], **call[1])
        else:
            with torch.no_grad():
                placed(*call[0], **call[1])
    return peaks


def example_model(name: str) -> tuple[torch.nn.Module, tuple, dict]:
    if name in ("gpt2", "bert"):
        import transformers

        torch.manual_seed(0)
        if name == "gpt2":
            config = transformers.GPT2Config(n_layer=4, n_embd=256, n_head=4, vocab_size=4096, n_positions=256,
                                             use_cache=False, bos_token_id=1, eos_token_id=1)
            model = transformers.GPT2LMHeadModel(config).eval()
        else:
            config = transformers.BertConfig(num_hidden_layers=4, hidden_size=256, num_attention_heads=4,
                                             intermediate_size=1024, vocab_size=4096)
            model = transformers.BertModel(config).eval()
        return model, (), {"input_ids": torch.randint(0, 4096, (8, 128))}
    model, inputs = build(name, batch=256 if name == "mlp" else 32)
    return model, inputs, {}


def _mib(n: float) -> str:
    return f"{n / 2**20:.2f}"


def mean_square_loss(out: Any, target: Any) -> torch.Tensor:
    """A mean-square loss of the model's first output (logits, hidden states) against zeros."""
    first = out if isinstance(out, torch.Tensor) else pytree.tree_leaves(out)[0]
    return first.float().pow(2).mean()


def _cuda_peaks(placed: Any, call: tuple[tuple, dict], train: Any) -> dict[str, int]:
    """Per CUDA device of the plan, what one call added to the caching allocator at its peak."""
    cudas = sorted({s.device for s in placed.plan.stages if s.device.startswith("cuda")})
    before = {d: torch.cuda.memory_allocated(d) for d in cudas}
    for d in cudas:
        torch.cuda.synchronize(d)
        torch.cuda.reset_peak_memory_stats(d)
    measured_peaks(placed, call, train)
    for d in cudas:
        torch.cuda.synchronize(d)
    return {d: torch.cuda.max_memory_allocated(d) - before[d] for d in cudas}


def rows(names: list[str], training: bool = False, device_sets: list[list[str]] | None = None,
         cap: float | None = None) -> list[tuple]:
    out = []
    for name in names:
        for devices in device_sets or (["cpu:0"], ["cpu:0", "cpu:1"]):
            for m in (1, 4):
                model, args, kwargs = example_model(name)  # a fresh copy: placing moves the model's own tensors
                if training:
                    model.train()
                batch = next(t for t in pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)).shape[0]
                train = (torch.zeros(batch), mean_square_loss) if training else None
                options: dict[str, Any] = {"mode": "training", "optimizer": "sgd", "schedule": "1f1b",
                                           "loss_fn": mean_square_loss, "example_target": train[0]} if train else {}
                if cap is not None and len(devices) > 1:
                    params = sum(p.numel() * p.element_size() for p in model.parameters())
                    options["max_memory"] = {devices[0]: int(cap * params)}
                placed = torchplace.place(model, devices, args, example_kwargs=kwargs, microbatches=m, progress=False,
                                          allow_single_device=False, repeats=1, warmup=0, time_limit=10, **options)
                measured_peaks(placed, (args, kwargs), train)  # warm-up
                peaks = measured_peaks(placed, (args, kwargs), train)
                allocator = _cuda_peaks(placed, (args, kwargs), train) if torch.cuda.is_available() else {}
                parts = costmodel.device_memory_parts(placed.problem, placed.plan.stages)
                for dev, p in parts.items():
                    fixed = p["parameters"] + p["shared copies"]
                    modelled = p["working"] + p["activations"] + p["gradients + optimizer"]
                    got = next((v for k, v in peaks.items() if dev in k), 0)
                    out.append((name, len(devices), m, dev, _mib(fixed), _mib(modelled), _mib(got),
                                f"{modelled / got:.2f}" if got else "-",
                                _mib(fixed + modelled), _mib(fixed + got),
                                f"{(fixed + modelled) / (fixed + got):.2f}" if fixed + got else "-",
                                _mib(allocator[dev]) if dev in allocator else "-"))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", nargs="+", default=["mlp", "resnet", "inception", "gpt2", "bert"])
    ap.add_argument("--training", action="store_true", help="one training step (SGD, 1F1B) instead of a call")
    ap.add_argument("--devices", nargs="+", help="device sets, comma-separated (default: cpu:0 and cpu:0,cpu:1)")
    ap.add_argument("--cap", type=float, help="the first device of a set of several: this share of the parameter bytes")
    a = ap.parse_args()
    print(f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}, "
          f"{date.today()}")
    modelled = "grads + act." if a.training else "act."
    header = ("model", "devices", "m", "device", "params MiB", f"{modelled} predicted", f"{modelled} measured", "ratio",
              "total predicted", "total measured", "ratio", "CUDA allocator peak added")
    print("| " + " | ".join(header) + " |")
    print("|" + "---|" * len(header))
    for r in rows(a.models, a.training, [d.split(",") for d in a.devices] if a.devices else None, a.cap):
        print("| " + " | ".join(map(str, r)) + " |")


if __name__ == "__main__":
    main()
