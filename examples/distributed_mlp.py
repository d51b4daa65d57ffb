"""Place an MLP over processes and run it with torch.distributed.pipelining.

    OMP_NUM_THREADS=1 torchrun --standalone --nproc-per-node 2 examples/distributed_mlp.py

Rank 0 solves the plan (the others wait for it), every rank keeps only its own stages' weights,
and the last rank prints the check of the outputs against the unsplit model and the losses of
five training steps (SGD, 1F1B; each rank steps its own parameters).
"""
from __future__ import annotations

import torch
from torch import nn

import torchplace.distributed as tpd


def build() -> tuple[nn.Module, torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)  # every rank builds the same model
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 8))
    return model, torch.randn(16, 32), torch.randn(16, 8)


def main() -> None:
    torch.set_num_threads(1)
    model, x, y = build()
    with torch.no_grad():
        expected = torch.cat([model(c) for c in x.tensor_split(4)])  # the model on the same micro-batches
    placed = tpd.place(model, (x,), microbatches=4, progress=False)
    out = placed.run(x)
    if placed.is_last:
        print(f"rank {placed.rank}: plan {[s.device for s in placed.plan.stages]}; "
              f"outputs equal to the unsplit model: {torch.equal(out, expected)}")
    placed.close()

    model, x, y = build()
    placed = tpd.place(model.train(), (x,), mode="training", microbatches=4, progress=False)
    opt = torch.optim.SGD(placed.parameters(), lr=0.1)
    for step in range(5):
        losses = placed.step(x, target=y, loss_fn=nn.functional.mse_loss)
        opt.step()
        opt.zero_grad()
        if placed.is_last:
            print(f"rank {placed.rank}: step {step}: mean loss {sum(losses).item() / len(losses):.5f}")
    placed.close(destroy=True)


if __name__ == "__main__":
    main()
