"""One rank of the multi-process tests (tests/test_distributed.py starts one process per rank,
as torchrun does: RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT in the environment).

    python tests/dist_worker.py SCENARIO[,SCENARIO...] OUT_DIR [PLAN.json|- ...]   (a plan per scenario)

Each rank computes the single-process reference itself (every rank holds the same seeded model
before placing) and writes what it found to ``OUT_DIR/rank{R}.json``.
"""
from __future__ import annotations

import copy
import json
import os
import signal
import sys
import time
import warnings
from pathlib import Path
from typing import Any

import torch
from torch import nn


class Bomb(nn.Module):
    """Identity, until armed: then it raises (``"raise"``) or kills its process (``"kill"``)."""

    armed = ""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if Bomb.armed == "raise":
            raise ValueError("bomb went off")
        if Bomb.armed == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        return x


class SkipNet(nn.Module):
    """An MLP whose input skips the middle layers (a value that crosses several stages)."""

    def __init__(self, width: int = 16, depth: int = 6) -> None:
        super().__init__()
        self.inp = nn.Linear(8, width)
        self.layers = nn.ModuleList(nn.Linear(width, width) for _ in range(depth))
        self.out = nn.Linear(width, 4)
        self.bomb = Bomb()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.inp(x))
        skip = h
        for layer in self.layers:
            h = torch.tanh(layer(h))
        return self.bomb(self.out(h + skip))


class TiedNet(nn.Module):
    """An MLP whose last layer reads the first layer's weight again (a tied weight, as GPT-2's)."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(8, 16)
        self.mid = nn.Sequential(nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.mid(torch.relu(self.inp(x)))) @ self.inp.weight[:, :4]


def build(seed: int = 0, tied: bool = False) -> tuple[nn.Module, torch.Tensor, torch.Tensor]:
    """SkipNet (or TiedNet) with weights from ``seed``; the inputs are the same for every seed."""
    torch.manual_seed(seed)
    model = TiedNet() if tied else SkipNet()
    torch.manual_seed(0)
    x, y = torch.randn(8, 8), torch.randn(8, 4)
    return model, x, y


def reference_output(model: nn.Module, x: torch.Tensor, m: int) -> torch.Tensor:
    with torch.no_grad():
        return torch.cat([model(c) for c in x.tensor_split(m)])


def reference_training(model: nn.Module, x: torch.Tensor, y: torch.Tensor, m: int, steps: int) -> dict:
    model = copy.deepcopy(model).train()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    for _ in range(steps):
        opt.zero_grad()
        loss = sum(nn.functional.mse_loss(model(c), t) for c, t in zip(x.tensor_split(m), y.tensor_split(m))) / m
        loss.backward()
        opt.step()
    return dict(model.named_parameters())


def run(scenario: str, plan: str | None, result: dict) -> None:
    """``infer``, ``train`` (``train@SCHEDULE`` for another engine schedule), ``checkpoint``, ``raise``,
    ``kill`` or ``raise-and-stay``."""
    import torchplace.distributed as tpd

    scenario, _, schedule = scenario.partition("@")
    linear = scenario.endswith("-tp")  # a plan traced with Linear modules as leaves: tensor parallel stages
    scenario = scenario.removesuffix("-tp")
    model, x, y = build(tied=scenario.startswith("train-tied") or scenario == "tied-hook")
    m = 4
    opts = dict(microbatches=m, leaf_modules=[Bomb, nn.Linear] if linear else [Bomb],
                timeout=float(os.environ.get("TP_TIMEOUT", "30")),
                progress=False, warmup=0, repeats=1, plan=plan, contiguous=plan is None)
    if scenario in ("infer", "raise", "kill", "raise-and-stay"):
        expected = reference_output(model, x, m)
        placed = tpd.place(model, (x,), **opts)
        result["layout"] = [[s.rank, list(s.pieces)] for s in placed.pipeline.slots]
        mine = {id(p) for p in placed.parameters()}
        result["others_real"] = [n for n, p in model.named_parameters() if id(p) not in mine and not p.is_meta]
        Bomb.armed = "" if scenario == "infer" else scenario.split("-")[0]
        try:
            got = placed.run(x)
        except Exception:
            if scenario == "raise-and-stay" and placed.is_last:  # the failing rank lingers: the others must not
                result["stayed"] = time.time()
                (Path(sys.argv[2]) / f"rank{placed.rank}.json").write_text(json.dumps({"0:" + scenario: result}))
                time.sleep(30)
            raise
        if placed.is_last:
            result["equal"] = bool(torch.equal(got, expected))
            result["max_diff"] = float((got - expected).abs().max())
    elif scenario == "odd-batch":  # a batch that does not split among the replicas' micro-batches
        placed = tpd.place(model, (x,), mode="training", **opts)
        try:
            placed.step(x[:6], target=y[:6], loss_fn=nn.functional.mse_loss)
        except Exception as error:  # noqa: BLE001 - the test reads the message
            result["refused"] = f"{type(error).__name__}: {error}"
    elif scenario in ("train", "train-tied", "train-tied-one-rank"):
        expected = reference_training(model, x, y, m, steps=5)
        model.train()
        placed = tpd.place(model, (x,), mode="training", schedule=schedule or None, **opts)
        result["layout"] = [[s.rank, list(s.pieces)] for s in placed.pipeline.slots]
        params = placed.parameters()
        opt = torch.optim.SGD(params, lr=0.05, momentum=0.9) if params else None  # a rank may hold none
        for _ in range(5):
            if opt is not None:
                opt.zero_grad()
            losses = placed.step(x, target=y, loss_fn=nn.functional.mse_loss)
            if opt is not None:
                opt.step()
        names = {id(p): n for n, p in model.named_parameters()}
        mine = [names[id(p)] for p in placed.parameters()]
        result["params"] = sorted(mine)
        now = {n: _whole(v) for n, v in model.named_parameters() if n in mine}  # tensor-parallel slices joined
        result["allclose"] = all(torch.allclose(now[n], expected[n], atol=1e-6) for n in mine)
        result["max_diff"] = max((float((now[n] - expected[n].detach()).abs().max()) for n in mine), default=0.0)
        result["sliced"] = sorted(n for n, v in model.named_parameters() if n in mine and hasattr(v, "full_tensor"))
        result["losses"] = [float(v) for v in losses]
        result["replica"] = placed.replica
    elif scenario == "accumulate":  # two steps without zero_grad: the gradients add up, as the model's do
        reference = copy.deepcopy(model).train()
        for _ in range(2):
            (sum(nn.functional.mse_loss(reference(c), t) for c, t in zip(x.tensor_split(m), y.tensor_split(m))) / m
             ).backward()
        model.train()
        placed = tpd.place(model, (x,), mode="training", **opts)
        for _ in range(2):
            placed.step(x, target=y, loss_fn=nn.functional.mse_loss)
        expected = dict(reference.named_parameters())
        names = {id(p): n for n, p in model.named_parameters()}
        mine = [names[id(p)] for p in placed.parameters()]
        result["params"] = sorted(mine)
        result["allclose"] = all(torch.allclose(p.grad, expected[names[id(p)]].grad, atol=1e-6)
                                 for p in placed.parameters())
    elif scenario == "input-grad":  # an input that requires grad gets the mean micro-batch loss's gradient
        model.train()
        reference = copy.deepcopy(model)
        xr = x.clone().requires_grad_()
        (sum(nn.functional.mse_loss(reference(c), t) for c, t in zip(xr.tensor_split(m), y.tensor_split(m))) / m
         ).backward()
        placed = tpd.place(model, (x,), mode="training", **opts)
        xp = x.clone().requires_grad_()
        xp.grad = torch.ones_like(x)  # accumulated earlier: kept, this step's added
        placed.step(xp, target=y, loss_fn=nn.functional.mse_loss)
        result["has_grad"] = placed.rank == 0 and xp.grad is not None
        result["allclose"] = placed.rank != 0 or torch.allclose(xp.grad, xr.grad + 1, atol=1e-6)
        result["params"] = []
    elif scenario == "tied-hook":  # a gradient hook on a weight two ranks read: refused on every rank
        model.train()
        placed = tpd.place(model, (x,), mode="training", **opts)
        model.inp.weight.register_hook(torch.sign)
        try:
            placed.step(x, target=y, loss_fn=nn.functional.mse_loss)
        except Exception as error:  # noqa: BLE001 - the test reads the message
            result["refused"] = f"{type(error).__name__}: {error}"
    elif scenario == "solve-fails":  # rank 0's solve raises, every rank catches it, then places again
        solving = {**opts, "plan": None, "contiguous": True}
        start = time.monotonic()
        try:
            tpd.place(model, (x,), **solving, solver="no-such-solver", plan_timeout=120)
        except Exception as error:  # noqa: BLE001 - the test reads the message
            result["failed"] = f"{type(error).__name__}: {error}"
        result["took"] = time.monotonic() - start
        expected = reference_output(model, x, m)
        placed = tpd.place(model, (x,), **solving)  # the earlier placement's fault is not this one's
        got = placed.run(x)
        if placed.is_last:
            result["equal"] = bool(torch.equal(got, expected))
    elif scenario == "none-input":  # forward(x, mask=None) placed with (x,): the None is not sent
        torch.manual_seed(0)
        model = OptionalMask().eval()
        expected = reference_output(model, x, m)
        placed = tpd.place(model, (x,), **{**opts, "plan": None, "contiguous": True})
        got = placed.run(x)
        if placed.is_last:
            result["equal"] = bool(torch.equal(got, expected))
        try:
            placed.run(x, torch.ones(8, 16))
        except Exception as error:  # noqa: BLE001 - the test reads the message
            result["refused"] = f"{type(error).__name__}: {error}"
    elif scenario == "scalar-output":  # a reduction returned with one micro-batch: not joined with torch.cat
        torch.manual_seed(0)
        model = SumsToo().eval()
        with torch.no_grad():
            expected = model(x)
        placed = tpd.place(model, (x,), **{**opts, "plan": None, "contiguous": True, "microbatches": 1})
        got = placed.run(x)
        if placed.is_last:
            result["equal"] = bool(torch.equal(got[0], expected[0]) and torch.equal(got[1], expected[1]))
    elif scenario == "unseeded":  # each rank builds its model with weights of its own: refused on every rank
        model, x, _ = build(seed=100 + int(os.environ["RANK"]))
        try:
            tpd.place(model, (x,), **{**opts, "plan": None, "contiguous": True})
        except Exception as error:  # noqa: BLE001 - the test reads the message
            result["refused"] = f"{type(error).__name__}: {error}"
        return
    elif scenario == "restart":  # a plan saved from a placement runs again without profiling
        from torchplace import api

        saved = Path(sys.argv[2]) / f"restart-{os.environ['RANK']}.json"
        expected = reference_output(model, x, m)
        tpd.place(copy.deepcopy(model), (x,), **{**opts, "plan": None, "contiguous": True}).plan.save(saved)
        calls: list[str] = []
        real = api.profile
        api.profile = lambda *a, **k: calls.append("profile") or real(*a, **k)
        try:
            placed = tpd.place(model, (x,), **{**opts, "plan": str(saved)})
        finally:
            api.profile = real
        result["profiled"] = calls
        got = placed.run(x)
        if placed.is_last:
            result["equal"] = bool(torch.equal(got, expected))
    elif scenario == "plan-refused":  # rank 1 places for training, so it refuses rank 0's inference plan
        start = time.time()
        try:
            tpd.place(model.train(os.environ["RANK"] == "1"), (x,), **{**opts, "plan": None, "contiguous": True},
                      mode="training" if os.environ["RANK"] == "1" else "inference")
        except Exception as error:  # noqa: BLE001 - the test reads the message
            result["refused"], result["took"] = f"{type(error).__name__}: {error}", time.time() - start
        return
    elif scenario == "scalar-output-train":  # a reduction returned by a model trained with micro-batches
        torch.manual_seed(0)
        model, target = SumsToo().train(), torch.randn(8, 8)

        def loss_fn(out: Any, t: torch.Tensor) -> torch.Tensor:
            return nn.functional.mse_loss(out[1], t)

        reference = copy.deepcopy(model)
        sum(loss_fn(reference(c), t) / m for c, t in zip(x.tensor_split(m), target.tensor_split(m))).backward()
        placed = tpd.place(model, (x,), mode="training", **{**opts, "plan": None, "contiguous": True})
        placed.step(x, target=target, loss_fn=loss_fn)
        expected = {n: p.grad for n, p in reference.named_parameters()}
        names = {id(p): n for n, p in model.named_parameters()}
        result["params"] = sorted(names[id(p)] for p in placed.parameters())
        result["allclose"] = all(torch.allclose(p.grad, expected[names[id(p)]], atol=1e-6)
                                 for p in placed.parameters())
        try:
            placed.run(x)
        except Exception as error:  # noqa: BLE001 - the test reads the message
            result["refused"] = f"{type(error).__name__}: {error}"
    elif scenario == "refused-on-one-rank":  # rank 1 passes a target of other rows; then a good step
        expected = reference_training(model, x, y, m, steps=1)
        model.train()
        placed = tpd.place(model, (x,), mode="training", **opts)
        start = time.monotonic()
        try:
            placed.step(x, target=y if placed.rank == 0 else y[:4], loss_fn=nn.functional.mse_loss)
        except Exception as error:  # noqa: BLE001 - the test reads the message
            result["refused"] = f"{type(error).__name__}: {error}"
        result["took"] = time.monotonic() - start
        params = placed.parameters()
        opt = torch.optim.SGD(params, lr=0.05, momentum=0.9)
        placed.step(x, target=y, loss_fn=nn.functional.mse_loss)  # the placement is still usable
        opt.step()
        names = {id(p): n for n, p in model.named_parameters()}
        result["allclose"] = all(torch.allclose(p, expected[names[id(p)]], atol=1e-6) for p in params)
    elif scenario == "raise-then-place":  # the last stage raises; every rank catches it, closes, places again
        expected = reference_output(model, x, m)
        placed = tpd.place(copy.deepcopy(model), (x,), **opts)  # a copy: the next placement needs every tensor
        Bomb.armed = "raise"
        start = time.monotonic()
        kept = None  # the script keeps the error (its frames hold the engine's stages) while it closes
        try:
            placed.run(x)
        except Exception as error:  # noqa: BLE001 - the test reads the message
            result["failed"] = f"{type(error).__name__}: {error}"
            kept = error
        result["took"] = time.monotonic() - start
        Bomb.armed = ""
        try:
            placed.run(x)
        except Exception as error:  # noqa: BLE001 - the test reads the message
            result["again"] = f"{type(error).__name__}: {error}"
        placed.close()  # frees a peer still blocked on this rank in the failed call
        result["kept"] = type(kept).__name__ if kept is not None else None
        del kept
        placed = tpd.place(model, (x,), **opts)
        got = placed.run(x)
        if placed.is_last:
            result["equal"] = bool(torch.equal(got, expected))
    elif scenario == "different-calls":  # run()/step() on different ranks, then other batch shapes: refused, then run
        expected = reference_output(model, x, m)
        placed = tpd.place(model.train(), (x,), mode="training", **opts)
        start = time.monotonic()
        try:
            placed.run(x) if placed.rank == 0 else placed.step(x, target=y, loss_fn=nn.functional.mse_loss)
        except Exception as error:  # noqa: BLE001 - the test reads the message
            result["refused"] = f"{type(error).__name__}: {error}"
        result["took"] = time.monotonic() - start
        start = time.monotonic()  # and different batch shapes (each rank would size its buffers by its own)
        try:
            placed.run(x if placed.rank == 0 else torch.cat([x, x]))
        except Exception as error:  # noqa: BLE001 - the test reads the message
            result["refused_shapes"] = f"{type(error).__name__}: {error}"
        result["took_shapes"] = time.monotonic() - start
        got = placed.run(x)
        if placed.is_last:
            result["equal"] = bool(torch.equal(got, expected))
    elif scenario == "one-microbatch":  # no schedule given: 1F1B needs a micro-batch per engine stage, GPipe runs
        expected = reference_training(model, x, y, 1, steps=2)
        model.train()
        one = {**opts, "microbatches": 1}
        try:
            tpd.place(copy.deepcopy(model), (x,), mode="training", schedule="1f1b", **one)
        except Exception as error:  # noqa: BLE001 - the test reads the message
            result["refused"] = f"{type(error).__name__}: {error}"
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            placed = tpd.place(model, (x,), mode="training", **one)
        result["warned"] = [str(w.message) for w in caught if "instead" in str(w.message)]
        result["schedule"], result["plan_schedule"] = placed.pipeline.schedule, placed.plan.meta.get("schedule")
        params = placed.parameters()
        opt = torch.optim.SGD(params, lr=0.05, momentum=0.9)
        for _ in range(2):
            opt.zero_grad()
            placed.step(x, target=y, loss_fn=nn.functional.mse_loss)
            opt.step()
        names = {id(p): n for n, p in model.named_parameters()}
        result["allclose"] = all(torch.allclose(p, expected[names[id(p)]], atol=1e-6) for p in params)
    elif scenario == "dp-buffers":  # data-parallel copies of batch norms: their buffers agree after each step
        placed = _dp_buffers(result, opts)
    elif scenario == "stateful":  # buffers written in forward: batch norm's statistics and a call counter
        placed = _stateful(result, opts)
    elif scenario == "transposed":  # a value whose gradient comes back transposed (not contiguous)
        placed = _one_step(Transposes(), result, {**opts, "plan": _cut_after(Transposes(), "mul")})
    elif scenario == "zero-bubble-output":  # a model output the last stage also saved for backward
        placed = _one_step(AlsoReturnsAHiddenState(), result, {**opts, "schedule": "zero-bubble", "plan": None,
                                                                "contiguous": True})
    elif scenario == "cluster":  # ``plan`` is a cluster file: two hosts joined by a priced link
        from torchplace.clusterfile import load_cluster

        expected = reference_output(model, x, m)
        placed = tpd.place(model, (x,), **{**opts, "plan": None, "contiguous": True}, devices=load_cluster(plan))
        got = placed.run(x)
        if placed.is_last:
            result["equal"] = bool(torch.equal(got, expected))
        result["layout"] = [[s.rank, list(s.pieces)] for s in placed.pipeline.slots]
        result["devices"] = [s.device for s in placed.plan.stages]
    elif scenario in ("checkpoint", "meta"):  # ``plan`` is a checkpoint of SkipNet seeded 1: ranks load their slices
        other, _, _ = build(seed=1)
        if scenario == "meta":  # built without memory: each rank materialises its own stages from the checkpoint
            with torch.device("meta"):
                model = SkipNet()
        expected = reference_output(other, x, m)
        placed = tpd.place(model, (x,), **{**opts, "plan": None, "contiguous": True}, state_dict=plan)
        got = placed.run(x)
        if placed.is_last:
            result["equal"] = bool(torch.equal(got, expected))
        result["layout"] = [[s.rank, list(s.pieces)] for s in placed.pipeline.slots]
    elif scenario == "dropout":  # masks drawn by two stages and two data-parallel copies of a training plan
        placed = _dropout(result, opts)
    elif scenario in ("gpt2", "gpt2-train"):  # a torch.export graph whose stages read the batch size as a number
        placed = _gpt2(scenario == "gpt2-train", result, opts)
    elif scenario == "fx-transformer":  # an fx graph whose blocks read B, T, C = x.shape: plain ints
        model, ids = build_transformer()
        expected = reference_output(model, ids, m)
        placed = tpd.place(model, (ids,), **{**opts, "leaf_modules": [], "plan": None, "contiguous": True})
        result["method"] = placed.problem.graph.meta["method"]
        result["layout"] = [[s.rank, list(s.pieces)] for s in placed.pipeline.slots]
        got = placed.run(ids)
        if placed.is_last:
            result["equal"] = bool(torch.equal(got, expected))
    elif scenario == "aux-output":  # outputs the loss ignores, a value a later stage detaches: grads None
        placed = _aux_output(result, {**opts, "schedule": schedule or None})
    else:
        raise ValueError(f"unknown scenario {scenario!r}")
    placed.close()


class Stateful(nn.Module):
    """Batch norms and a counter of calls: buffers every forward writes."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.c = nn.Linear(8, 16), nn.Linear(16, 16), nn.Linear(16, 4)
        self.bn_a, self.bn_b = nn.BatchNorm1d(16), nn.BatchNorm1d(16)
        self.register_buffer("calls", torch.zeros(()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.bn_a(self.a(x)))
        h = torch.relu(self.bn_b(self.b(h)))
        self.calls += 1
        return self.c(h) + self.calls  # added: a product would save it for a backward after the next write


def _stateful(result: dict, opts: dict) -> Any:
    """Two training steps: the buffers each rank's stages write, beside one process's."""
    import torchplace.distributed as tpd

    torch.manual_seed(0)
    model, x, y, m = Stateful().train(), torch.randn(8, 8), torch.randn(8, 4), opts["microbatches"]
    reference = copy.deepcopy(model)
    opt = torch.optim.SGD(reference.parameters(), lr=0.05)
    for _ in range(2):
        opt.zero_grad()
        parts = zip(x.tensor_split(m), y.tensor_split(m))
        sum(nn.functional.mse_loss(reference(c), t) / m for c, t in parts).backward()
        opt.step()
    placed = tpd.place(model, (x,), mode="training", **{**opts, "plan": None, "contiguous": True})
    opt = torch.optim.SGD(placed.parameters(), lr=0.05)
    for _ in range(2):
        opt.zero_grad()
        placed.step(x, target=y, loss_fn=nn.functional.mse_loss)
        opt.step()
    mine = {id(t) for module in placed.pipeline.modules for t in module.buffers()}
    expected = dict(reference.named_buffers())
    result["buffers"] = sorted(n for n, b in model.named_buffers() if id(b) in mine)
    result["allclose"] = all(torch.allclose(b.float(), expected[n].float(), atol=1e-6)
                             for n, b in model.named_buffers() if id(b) in mine)
    result["params"] = []
    return placed


class OptionalMask(nn.Module):
    """A mask that may be left out (``None``: fx traces its branch only)."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.c = nn.Linear(8, 16), nn.Linear(16, 16), nn.Linear(16, 16)

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        out = self.c(torch.tanh(self.b(torch.relu(self.a(x)))))
        return out if mask is None else out * mask


class SumsToo(nn.Module):
    """Returns a zero-dimensional reduction beside its output (placed with one micro-batch)."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.c = nn.Linear(8, 16), nn.Linear(16, 16), nn.Linear(16, 8)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        out = self.c(torch.tanh(self.b(torch.relu(self.a(x)))))
        return out.sum(), out


class Normed(nn.Module):
    """A batch norm in each half (the plan files of :func:`noncontiguous_plan` cut it in two)."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.bn_a, self.b = nn.Linear(8, 16), nn.BatchNorm1d(16), nn.Linear(16, 16)
        self.c, self.bn_c, self.d = nn.Linear(16, 16), nn.BatchNorm1d(16), nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.b(torch.relu(self.bn_a(self.a(x)))))
        return self.d(torch.relu(self.bn_c(self.c(h))))


class Block(nn.Module):
    """A transformer block that reads its input's sizes as Python numbers (``B, T, C = x.shape``),
    as nanoGPT's do: plain ints of an fx graph, which torch.distributed.pipelining cannot send."""

    def __init__(self, width: int = 16, heads: int = 2) -> None:
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.qkv, self.proj = nn.Linear(width, 3 * width), nn.Linear(width, width)
        self.fc1, self.fc2 = nn.Linear(width, 2 * width), nn.Linear(2 * width, width)
        self.heads = heads

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(C, dim=-1)
        q, k, v = (t.view(B, T, self.heads, C // self.heads).transpose(1, 2) for t in (q, k, v))
        a = torch.softmax(q @ k.transpose(-1, -2), dim=-1) @ v
        x = x + self.proj(a.transpose(1, 2).reshape(B, T, C))
        return x + self.fc2(nn.functional.gelu(self.fc1(self.ln2(x))))


class Transformer(nn.Module):
    """Three :class:`Block` between an embedding and a head (found failing by fuzzing: solved plans
    cut between a block's ``x.shape`` and the reshapes that read it)."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(23, 16)
        self.blocks = nn.Sequential(Block(), Block(), Block())
        self.head = nn.Linear(16, 23)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.blocks(self.emb(ids)))


def build_transformer() -> tuple[nn.Module, torch.Tensor]:
    """The :class:`Transformer` in eval mode and a batch of 8 sequences of 6 token ids."""
    torch.manual_seed(0)
    return Transformer().eval(), torch.randint(0, 23, (8, 6))


def build_normed() -> tuple[nn.Module, torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    model = Normed().train()
    return model, torch.randn(8, 8), torch.randn(8, 4)


class Dropped(nn.Module):
    """Two dropout masks of ones, one per stage of a two-stage plan: ``[h | g]``, each 0 or 2."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.drop = nn.Linear(8, 8), nn.Linear(8, 8), nn.Dropout(0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.drop(torch.sigmoid(self.a(x)) * 0 + 1)
        g = self.drop(torch.sigmoid(self.b(h)) * 0 + 1)
        return torch.cat([h, g], dim=1)


def build_dropped() -> tuple[nn.Module, torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    return Dropped().train(), torch.ones(8, 8), torch.zeros(8, 16)


def _dropout(result: dict, opts: dict) -> Any:
    """The masks of :class:`Dropped` run by its training plan (two stages, each on two copies),
    on the last rank of each copy: both stages' halves, both copies' rows, two calls and a call
    again after the same seeding."""
    import torchplace.distributed as tpd

    model, x, _ = build_dropped()
    placed = tpd.place(model, (x,), mode="training", **opts)
    torch.manual_seed(7)
    first, second = placed.run(x), placed.run(x)
    torch.manual_seed(7)
    again = placed.run(x)
    result["params"] = []
    if placed.is_last:
        result["values"] = sorted(set(first.flatten().tolist()))
        result["stages_alike"] = bool(torch.equal(first[:, :8], first[:, 8:]))
        result["copies_alike"] = bool(torch.equal(first[:4], first[4:]))
        result["calls_alike"] = bool(torch.equal(first, second))
        result["reseeded_alike"] = bool(torch.equal(first, again))
    return placed


def _dp_buffers(result: dict, opts: dict) -> Any:
    """Two SGD steps of :class:`Normed` in 2 data-parallel copies: each rank's buffers, and one
    process's simulation of what the copies should hold: per step, each copy's micro-batches run
    from the same buffers, then floating buffers are the copies' mean and integer ones the start
    plus every copy's increment (the parameters move on the whole batch's gradient)."""
    import torchplace.distributed as tpd

    model, x, y = build_normed()
    m, copies = opts["microbatches"], 2
    reference = copy.deepcopy(model)
    opt = torch.optim.SGD(reference.parameters(), lr=0.05)
    parts = list(zip(x.tensor_split(m), y.tensor_split(m)))
    for _ in range(2):
        opt.zero_grad()
        start = {n: b.clone() for n, b in reference.named_buffers()}
        ends = []
        for j in range(copies):
            with torch.no_grad():
                for n, b in reference.named_buffers():
                    b.copy_(start[n])
            for c, t in parts[j * m // copies:(j + 1) * m // copies]:
                (nn.functional.mse_loss(reference(c), t) / m).backward()
            ends.append({n: b.clone() for n, b in reference.named_buffers()})
        with torch.no_grad():
            for n, b in reference.named_buffers():
                b.copy_(sum(e[n] for e in ends) / copies if b.is_floating_point()
                        else start[n] + sum(e[n] - start[n] for e in ends))
        opt.step()
    unsplit = copy.deepcopy(model)  # one pipeline on the whole batch: the counters' relation
    for _ in range(2):
        for c in x.tensor_split(m):
            unsplit(c)
    placed = tpd.place(model, (x,), mode="training", **opts)
    opt = torch.optim.SGD(placed.parameters(), lr=0.05)
    for _ in range(2):
        opt.zero_grad()
        placed.step(x, target=y, loss_fn=nn.functional.mse_loss)
        opt.step()
    mine = {id(t) for module in placed.pipeline.modules for t in module.buffers()}
    held = {n: b for n, b in model.named_buffers() if id(b) in mine}
    expected, counted = dict(reference.named_buffers()), dict(unsplit.named_buffers())
    result["buffers"] = {n: b.tolist() for n, b in held.items()}
    result["allclose"] = all(torch.allclose(b.float(), expected[n].float(), atol=1e-6) for n, b in held.items())
    result["counted"] = {n: [int(b), int(counted[n])] for n, b in held.items() if not b.is_floating_point()}
    result["params"] = []
    return placed


class Transposes(nn.Module):
    """Cut after the product, the second stage transposes what it receives: its gradient goes back
    transposed, a tensor gloo cannot send."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.a(x)).view(-1, 2, 4).transpose(1, 2) * 2
        return self.b(h.transpose(1, 2).reshape(-1, 8))


class AlsoReturnsAHiddenState(nn.Module):
    """Returns ``g`` beside the output made from it: the zero-bubble backward detached the sent
    ``g`` in place, and its weight pass then found what it had saved detached."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.c, self.d = (nn.Linear(8, 8) for _ in range(4))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.relu(self.c(torch.relu(self.b(torch.relu(self.a(x))))))
        return self.d(g), g


def _cut_after(model: nn.Module, node: str) -> Any:
    """A training plan of two pieces, cpu:0 up to the first forward node named ``node*``."""
    from torchplace import api
    from torchplace.plan import Plan, Stage

    torch.manual_seed(0)
    placement = api.prepare(model.train(), ["cpu:0", "cpu:1"], (torch.randn(8, 8),), mode="training",
                            contiguous=False, microbatches=4, progress=False, warmup=0, repeats=1, recompute=False)
    graph = placement.problem.graph
    forward = [v for v in graph.topological_order() if not graph.record(v).backward]
    k = next(i for i, v in enumerate(forward) if v.startswith(node)) + 1
    pieces = [tuple(forward[:k]), tuple(forward[k:])]
    back = {v: [b for b in graph if graph.record(b).backward and b.split(":")[0] == v] for v in forward}
    stages = [Stage(f"cpu:{d}", p) for d, p in enumerate(pieces)]
    stages += [Stage(f"cpu:{d}", tuple(b for v in p for b in back[v])) for d, p in reversed(list(enumerate(pieces)))]
    return Plan.build(placement.problem, stages, solver="by hand", seconds=0.0, lower_bound=0.0, status="feasible")


def _one_step(model: nn.Module, result: dict, opts: dict) -> Any:
    """One training step of ``model`` (first output against a target): each rank's gradients beside
    one process's."""
    import torchplace.distributed as tpd

    torch.manual_seed(0)
    model.load_state_dict(type(model)().state_dict())  # the same weights on every rank
    model.train()
    x, y, m = torch.randn(8, 8), torch.randn(8, 8), opts["microbatches"]

    def loss_fn(out: Any, target: torch.Tensor) -> torch.Tensor:
        return nn.functional.mse_loss(out[0] if isinstance(out, tuple) else out, target)

    reference = copy.deepcopy(model)
    sum(loss_fn(reference(c), t) / m for c, t in zip(x.tensor_split(m), y.tensor_split(m))).backward()
    placed = tpd.place(model, (x,), mode="training", **opts)
    placed.step(x, target=y, loss_fn=loss_fn)
    expected = {n: p.grad for n, p in reference.named_parameters()}
    names = {id(p): n for n, p in model.named_parameters()}
    result["params"] = sorted(names[id(p)] for p in placed.parameters())
    result["allclose"] = all(torch.allclose(p.grad, expected[names[id(p)]], atol=1e-6) for p in placed.parameters())
    result["plan_schedule"] = placed.plan.meta.get("schedule")  # whose activations in flight the plan counted
    return placed


def _gpt2(training: bool, result: dict, opts: dict) -> Any:
    """A small GPT-2 (no dropout): its outputs, or its parameters after 3 SGD steps, beside one process's."""
    import torchplace.distributed as tpd
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    config = GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=64, n_positions=32, use_cache=False,
                        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    model = GPT2LMHeadModel(config).train(training)
    ids, labels = torch.randint(0, 64, (8, 12)), torch.randint(0, 64, (8, 12))
    m = opts["microbatches"]
    opts = {**opts, "leaf_modules": [], "plan": None, "contiguous": True}

    def loss_fn(out: Any, target: torch.Tensor) -> torch.Tensor:
        return nn.functional.cross_entropy(out["logits"].flatten(0, 1), target.flatten())

    if not training:
        expected = torch.cat([model(input_ids=c).logits for c in ids.tensor_split(m)]).detach()
        placed = tpd.place(model, (), example_kwargs={"input_ids": ids}, **opts)
        result["numbers"] = sorted({r.name for s in placed.pipeline.slots for r in s.numbers})
        got = placed.run(input_ids=ids)
        if placed.is_last:
            result["equal"] = bool(torch.equal(got["logits"], expected))
        return placed
    reference = copy.deepcopy(model)
    opt = torch.optim.SGD(reference.parameters(), lr=0.05)
    for _ in range(3):
        opt.zero_grad()
        parts = zip(ids.tensor_split(m), labels.tensor_split(m))
        sum(loss_fn(reference(input_ids=c), t) / m for c, t in parts).backward()
        opt.step()
    placed = tpd.place(model, (), example_kwargs={"input_ids": ids}, mode="training", **opts)
    result["numbers"] = sorted({r.name for s in placed.pipeline.slots for r in s.numbers})
    opt = torch.optim.SGD(placed.parameters(), lr=0.05)
    for _ in range(3):
        opt.zero_grad()
        placed.step(input_ids=ids, target=labels, loss_fn=loss_fn)
        opt.step()
    expected = dict(reference.named_parameters())
    mine = [n for n, p in model.named_parameters() if any(p is q for q in placed.parameters())]
    result["params"], result["all"] = sorted(mine), sorted(expected)
    result["max_diff"] = max((float((p - expected[n]).abs().max()) for n, p in model.named_parameters() if n in mine),
                             default=0.0)
    return placed


class AuxHeads(nn.Module):
    """Three auxiliary outputs beside the main one and a gate a later stage detaches (stop-gradient).
    In :func:`aux_plan`'s pieces (rank 0: ``a``, ``gate``, ``aux``; rank 1: ``b``, ``aux2`` and
    ``aux``'s weight again; rank 0: ``c``; rank 1: ``d``) ``aux``'s and ``gate``'s outputs cross
    engine stages, ``aux.weight`` is read on both ranks, and :func:`aux_loss` reads ``aux2``'s
    output in some micro-batches only."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.gate, self.aux = nn.Linear(8, 16), nn.Linear(8, 16), nn.Linear(16, 3)
        self.b, self.aux2 = nn.Linear(16, 16), nn.Linear(16, 3)
        self.c, self.d = nn.Linear(16, 16), nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        h, g = torch.relu(self.a(x)), self.gate(x)
        aux = self.aux(h)
        h = torch.tanh(self.b(h))
        aux2, echo = self.aux2(h), nn.functional.linear(h, self.aux.weight)
        h = torch.tanh(self.c(h)) * torch.sigmoid(g.detach())
        return self.d(h), aux, aux2, echo


def aux_loss(out: tuple[torch.Tensor, ...], target: torch.Tensor) -> torch.Tensor:
    """The main output's error, and ``aux2``'s size where the micro-batch's ``target[0, 2] > 0``
    (the first of :func:`build_aux`'s 4 micro-batches: in 2 data-parallel copies, the first
    copy's); the other auxiliary outputs never."""
    loss = nn.functional.mse_loss(out[0], target)
    return loss + out[2].square().mean() if target[0, 2] > 0 else loss


def build_aux() -> tuple[nn.Module, torch.Tensor, torch.Tensor]:
    """:class:`AuxHeads` and :func:`build`'s inputs."""
    torch.manual_seed(0)
    model = AuxHeads().train()
    torch.manual_seed(0)
    return model, torch.randn(8, 8), torch.randn(8, 4)


def aux_plan(path: str, data_parallel: int = 1) -> None:
    """Save a training plan of :class:`AuxHeads` in four pieces on cpu:0, cpu:1, cpu:0, cpu:1
    (its class docs; the backward of each piece on its device, in reverse order), every stage
    with ``data_parallel``."""
    from torchplace import api
    from torchplace.plan import Plan, Stage

    model, x, _ = build_aux()
    placement = api.prepare(model, ["cpu:0", "cpu:1"], (x,), mode="training", contiguous=False, microbatches=4,
                            progress=False, warmup=0, repeats=1, recompute=False, sends_tensors_only=True)
    graph = placement.problem.graph
    forward = [v for v in graph.topological_order() if not graph.record(v).backward]
    cuts = [forward.index(v) for v in ("linear_3", "linear_6", "linear_7")]  # b's, c's and d's (fx names)
    pieces = [tuple(forward[i:j]) for i, j in zip([0, *cuts], [*cuts, len(forward)])]
    devices = ["cpu:0", "cpu:1", "cpu:0", "cpu:1"]
    back = {v: [b for b in graph if graph.record(b).backward and b.split(":")[0] == v] for v in forward}
    stages = [Stage(d, p, data_parallel=data_parallel) for d, p in zip(devices, pieces)]
    stages += [Stage(d, tuple(b for v in p for b in back[v]), data_parallel=data_parallel)
               for d, p in reversed(list(zip(devices, pieces)))]
    Plan.build(placement.problem, stages, solver="by hand", seconds=0.0, lower_bound=0.0, status="feasible").save(path)


def _aux_output(result: dict, opts: dict) -> Any:
    """Three AdamW steps of :class:`AuxHeads` on :func:`aux_plan`'s plan: which parameters have no
    gradient after each step, and the parameters after the last, beside one process's."""
    import torchplace.distributed as tpd

    model, x, y = build_aux()
    m = opts["microbatches"]
    reference = copy.deepcopy(model)
    placed = tpd.place(model, (x,), mode="training", **opts)
    names = {id(p): n for n, p in model.named_parameters()}
    mine = {names[id(p)]: p for p in placed.parameters()}
    expected = dict(reference.named_parameters())
    ropt, opt = torch.optim.AdamW(reference.parameters(), lr=1e-2), torch.optim.AdamW(placed.parameters(), lr=1e-2)
    result["none"], result["expected_none"] = [], []
    for _ in range(3):
        ropt.zero_grad()
        sum(aux_loss(reference(c), t) / m for c, t in zip(x.tensor_split(m), y.tensor_split(m))).backward()
        ropt.step()
        opt.zero_grad()
        placed.step(x, target=y, loss_fn=aux_loss)
        opt.step()
        result["none"].append(sorted(n for n, p in mine.items() if p.grad is None))
        result["expected_none"].append(sorted(n for n in mine if expected[n].grad is None))
    result["params"] = sorted(mine)
    result["allclose"] = all(torch.allclose(p, expected[n], atol=1e-6) for n, p in mine.items())
    result["max_diff"] = max((float((p - expected[n]).abs().max()) for n, p in mine.items()), default=0.0)
    return placed


def _whole(t: torch.Tensor) -> torch.Tensor:
    """``t``, or the whole tensor of a tensor-parallel slice (a collective over its ranks)."""
    return t.full_tensor().detach() if hasattr(t, "full_tensor") else t.detach()


def main() -> None:
    torch.set_num_threads(1)  # here, not at import: the test process imports this module too
    scenarios, out = sys.argv[1].split(","), Path(sys.argv[2])
    plans = [None if p == "-" else p for p in sys.argv[3:]]
    rank = int(os.environ["RANK"])
    results: dict = {}
    for i, scenario in enumerate(scenarios):
        result = results[f"{i}:{scenario}"] = {}
        try:
            run(scenario, plans[i] if i < len(plans) else None, result)
        except Exception as error:  # noqa: BLE001 - reported to the test through the file and the exit status
            result["error"] = f"{type(error).__name__}: {error}"
            result["at"] = time.time()
            (out / f"rank{rank}.json").write_text(json.dumps(results))
            print(f"rank {rank}: {result['error']}", file=sys.stderr, flush=True)
            sys.exit(1)
    (out / f"rank{rank}.json").write_text(json.dumps(results))


if __name__ == "__main__":
    main()


def noncontiguous_plan(path: str, mode: str, tied: bool = False,
                       devices: tuple[str, ...] = ("cpu:0", "cpu:1", "cpu:0", "cpu:1"), data_parallel: int = 1,
                       tensor_parallel: int = 1, normed: bool = False, dropped: bool = False) -> list[str]:
    """Save a plan of :class:`SkipNet` (or :class:`TiedNet`, :class:`Normed`, :class:`Dropped`) in pieces of equal length on
    ``devices`` (a training plan has the backward of each piece on its device, in reverse order),
    every stage with ``data_parallel`` and ``tensor_parallel`` (traced with Linear modules as leaves
    when it is above 1); return the stage devices."""
    from torchplace import api
    from torchplace.plan import Plan, Stage

    model, x, _ = build_normed() if normed else build_dropped() if dropped else build(tied=tied)
    model.train(mode == "training")
    leaves = [Bomb, nn.Linear] if tensor_parallel > 1 else [Bomb]
    placement = api.prepare(model, ["cpu:0", "cpu:1"], (x,), mode=mode, contiguous=False, leaf_modules=leaves,
                            microbatches=4, progress=False, warmup=0, repeats=1,
                            **({"recompute": False} if mode == "training" else {}))
    graph = placement.problem.graph
    forward = [v for v in graph.topological_order() if not graph.record(v).backward]
    pieces = [tuple(c) for c in _chunks(forward, len(devices))]
    degrees = dict(data_parallel=data_parallel, tensor_parallel=tensor_parallel)
    stages = [Stage(d, p, **degrees) for d, p in zip(devices, pieces)]
    if mode == "training":
        back = {v: [b for b in graph if graph.record(b).backward and b.split(":")[0] == v] for v in forward}
        stages += [Stage(d, tuple(b for v in p for b in back[v]), **degrees)
                   for d, p in reversed(list(zip(devices, pieces)))]
    plan = Plan.build(placement.problem, stages, solver="by hand", seconds=0.0, lower_bound=0.0, status="feasible")
    plan.save(path)
    return [s.device for s in plan.stages]


def _chunks(items: list, n: int) -> list[list]:
    size = -(-len(items) // n)
    return [items[i:i + size] for i in range(0, len(items), size)]
