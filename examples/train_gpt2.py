"""Train GPT-2 placed on two devices, beside the same model trained unplaced, and compare.

    HF_HUB_OFFLINE=1 python examples/train_gpt2.py [--steps 10] [--devices cpu:0 cpu:1]

A transformers GPT-2 is built from a config (random weights, nothing downloaded) and trained on
random tokens with AdamW. ``torchplace.place(..., mode="training")`` splits it at ``GPT2Block``
granularity over the devices (two GPUs, or ``cuda:0`` + ``cpu``, where present; else two logical
CPUs) and trains it with the 1F1B schedule; where one device is predicted faster than the split
(a small model on two logical CPUs often is), ``place()`` runs it there and warns, and
``--keep-split`` keeps the split. A copy of the model is trained unplaced on the same
micro-batches. The script prints the plan, each step's loss for both (equal up to float rounding:
dropout is off so that they can be compared) and the samples per second of each.
"""
from __future__ import annotations

import argparse
import copy
import os
import time

import torch
from torch import nn

import torchplace


def default_devices() -> list[str]:
    n = torch.cuda.device_count()
    return ["cuda:0", "cuda:1"] if n >= 2 else ["cuda:0", "cpu"] if n == 1 else ["cpu:0", "cpu:1"]


def gpt2(layers: int, width: int, vocab: int, seq: int) -> nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(n_layer=layers, n_embd=width, n_head=4, vocab_size=vocab, n_positions=seq, use_cache=False,
                        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=vocab - 1,
                        eos_token_id=vocab - 1)
    return GPT2LMHeadModel(config)


def lm_loss(out, labels: torch.Tensor) -> torch.Tensor:
    """Next-token cross-entropy (labels are the inputs shifted by one)."""
    return nn.functional.cross_entropy(out.logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten())


def unplaced_step(model: nn.Module, ids: torch.Tensor, microbatches: int) -> float:
    """The unsplit model on the same micro-batches, the loss averaged over them."""
    total = 0.0
    for part in ids.tensor_split(microbatches):
        loss = lm_loss(model(part), part)
        (loss / microbatches).backward()
        total += loss.item() / microbatches
    return total


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--devices", nargs="+", default=default_devices())
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--width", type=int, default=128)
    ap.add_argument("--microbatches", type=int, default=4)
    ap.add_argument("--schedule", choices=["1f1b", "gpipe"], default="1f1b")
    ap.add_argument("--keep-split", action="store_true",
                    help="keep the split even where one device is predicted faster")
    args = ap.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")

    torch.manual_seed(0)
    vocab = 2048
    model = gpt2(args.layers, args.width, vocab, args.seq).train()
    reference = copy.deepcopy(model)
    tokens = torch.Generator().manual_seed(1)
    batches = [torch.randint(0, vocab, (args.batch, args.seq), generator=tokens) for _ in range(args.steps)]

    placed = torchplace.place(model, args.devices, (batches[0],), mode="training", microbatches=args.microbatches,
                              schedule=args.schedule, optimizer="adamw", granularity="module",
                              leaf_modules=["GPT2Block"], allow_single_device=not args.keep_split, progress=False)
    print(placed.plan)
    print("device_map:", placed.device_map(), "\n")

    opt = torch.optim.AdamW(placed.parameters(), lr=3e-4)  # the model's own parameters, on their devices
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=3e-4)
    placed_s = unplaced_s = 0.0
    print(f"{'step':>4}  {'placed loss':>12}  {'unplaced loss':>13}  {'difference':>10}")
    for step, ids in enumerate(batches):
        t0 = time.perf_counter()
        losses = placed.step(ids, target=ids, loss_fn=lm_loss)
        opt.step()
        opt.zero_grad()
        t1 = time.perf_counter()
        ref_loss = unplaced_step(reference, ids, args.microbatches)
        ref_opt.step()
        ref_opt.zero_grad()
        t2 = time.perf_counter()
        loss = float(torch.stack(losses).mean())
        if step:  # the first step of each warms up
            placed_s, unplaced_s = placed_s + t1 - t0, unplaced_s + t2 - t1
        print(f"{step:>4}  {loss:>12.6f}  {ref_loss:>13.6f}  {abs(loss - ref_loss):>10.2e}")
    samples = args.batch * (args.steps - 1)
    if samples:
        used = " + ".join(dict.fromkeys(s.device for s in placed.plan.stages))
        print(f"\nsamples/s: placed {samples / placed_s:.1f} on {used}, "
              f"unplaced {samples / unplaced_s:.1f} (same micro-batches, one device)")


if __name__ == "__main__":
    main()
