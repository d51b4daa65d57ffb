"""Feed torchplace the unusual and bad inputs a new user tries, and print what each one gets.

Run:  python benchmarks/robustness.py [--markdown]

Every case is one input: an argument of ``place()``, a call of a placed model, an operation on
one, a workload / cluster / plan file, a command line. The outcome is one of

* ``ok``: a valid (if unusual) input; the result was checked equal to eager PyTorch's;
* ``refused``: a :class:`~torchplace.errors.TorchplaceError` with a one-line message (for the
  command line: exit status 2 and one line on stderr);
* ``WRONG``: a result that differs from eager PyTorch, or a bad input silently accepted;
* ``CRASH``: any other exception (an internal traceback), or a message of several lines.

The exit status is 1 if any case is WRONG or a CRASH. ``tests/test_robustness.py`` runs every case.
"""
from __future__ import annotations

import argparse
import contextlib
import copy
import io
import json
import os
import pickle
import platform
import sys
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from datetime import date
from pathlib import Path
from typing import Any

import torch
from torch import nn

import torchplace
from torchplace.clusterfile import load_cluster
from torchplace.errors import TorchplaceError

WORKLOADS = Path(__file__).resolve().parents[1].parent / "shared" / "workloads"
BERT24 = WORKLOADS / "dnn-partitioning" / "throughput" / "LayerGraphs" / "bert24_inference.json"
MOIRAI = WORKLOADS / "moirai" / "example-1__instances.csv"
BERT12 = WORKLOADS / "dnn-partitioning" / "throughput" / "OperatorGraphs" / "bert_l-12_inference.json"
QUICK = {"progress": False, "repeats": 1, "warmup": 0}
DEVICES = ["cpu:0", "cpu:1"]


@dataclass(frozen=True)
class Row:
    area: str
    case: str
    outcome: str
    detail: str


class _Wrong(Exception):
    """A case found a result that differs from eager PyTorch, or a bad input was accepted."""


# -- the models the cases use ----------------------------------------------------------------------
def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4)).eval()


class _ReluAfterRead(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b, self.c = nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x):
        h = self.a(x)
        g = self.b(h)
        h.relu_()
        return self.c(h) + g


class _WritesInput(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x):
        y = self.a(x)
        x.mul_(2.0)
        return y + self.b(x)


class _ReturnsItsInput(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a = nn.Linear(8, 8)

    def forward(self, x):
        return self.a(x), x


class _Counter(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a = nn.Linear(8, 8)
        self.register_buffer("n", torch.zeros(()))

    def forward(self, x):
        self.n += 1
        return self.a(x) * self.n


class _Tied(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb, self.mid = nn.Embedding(20, 8), nn.Linear(8, 8)
        self.head = nn.Linear(8, 20, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, ids):
        return self.head(torch.tanh(self.mid(self.emb(ids))))


class _Identity(nn.Module):
    def forward(self, x):
        return x


class _Branchy(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(8, 8)

    def forward(self, x):
        if x.sum() > 0:  # data-dependent control flow: no graph captures it
            return self.a(x)
        return -x


class _FixedBatch(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(8, 8)

    def forward(self, x):
        return self.a(x).view(6, 2, 4).sum(1)  # the example's batch size, baked in


@dataclass
class _Halves:
    first: torch.Tensor
    second: torch.Tensor


class _ReturnsADataclass(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x):
        h = self.a(x)
        return _Halves(h, self.b(h))  # torch's pytree does not know the class: micro-batches cannot join it


def _x(batch: int = 6) -> torch.Tensor:
    torch.manual_seed(1)
    return torch.randn(batch, 8)


# -- case helpers -------------------------------------------------------------------------------------
def _place(model: nn.Module, inputs: Any = None, devices: Any = None, **options: Any) -> Any:
    return torchplace.place(model, DEVICES if devices is None else devices, (_x(),) if inputs is None else inputs,
                            **{**QUICK, "microbatches": 1, **options})


def _same(model_factory: Callable[[], nn.Module], inputs: Callable[[], Any], calls: int = 2, **options: Any) -> None:
    """Placed and eager agree on outputs, written inputs and buffers, call after call."""
    model, reference = model_factory(), model_factory()
    placed = _place(model, inputs(), **options)
    for _ in range(calls):
        a, b = inputs(), inputs()
        with torch.no_grad():
            ya, yb = placed(*a) if isinstance(a, tuple) else placed(a), reference(*b) if isinstance(b, tuple) else reference(b)
        if not torch.equal(ya, yb) or not all(torch.equal(p, q) for p, q in zip(_tensors(a), _tensors(b))):
            raise _Wrong("differs from eager PyTorch")
        if not all(torch.equal(p, q) for p, q in zip(model.buffers(), reference.buffers())):
            raise _Wrong("buffers differ from eager PyTorch")


def _tensors(value: Any) -> list[torch.Tensor]:
    return [t for t in (value if isinstance(value, tuple) else (value,)) if isinstance(t, torch.Tensor)]


def _placed_mlp() -> Any:
    return _place(_mlp())


def _cli(argv: list[str]) -> None:
    """A command line that must end with exit status 2 and one line on stderr."""
    from torchplace.cli import main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(argv)
    lines = err.getvalue().strip().splitlines()
    if code != 2 or len(lines) != 1 or not lines[0].startswith("torchplace: error:"):
        raise RuntimeError(f"exit {code}, stderr {err.getvalue()[:300]!r}")
    raise _CliRefused(lines[0])


class _CliRefused(Exception):
    pass


def _bad_files(tmp: Path) -> dict[str, str]:
    node = {"id": "1", "supportedOnFpga": 1, "cpuLatency": 1.0, "fpgaLatency": 1.0, "parameterSize": 1,
            "size": 1, "isBackwardNode": 0, "colorClass": None}
    base = {"maxSizePerFPGA": 10, "maxFPGAs": 2, "maxCPUs": 1, "nodes": [node], "edges": []}
    plan = {"format": "torchplace.plan/1", "objective": 1.0, "lower_bound": 1.0, "solver": "dp", "seconds": 0.1,
            "status": "optimal", "stages": [{"device": "acc0", "nodes": ["1"]}]}
    texts = {
        "nan-latency.json": json.dumps({**base, "nodes": [{**node, "cpuLatency": float("nan")}]}),
        "inf-size.json": json.dumps({**base, "nodes": [{**node, "size": float("inf")}]}),
        "huge-size.json": json.dumps(base).replace('"size": 1', '"size": 1' + "0" * 400),
        "fraction-fpgas.json": json.dumps({**base, "maxFPGAs": 2.7}),
        "fraction-size.json": json.dumps({**base, "nodes": [{**node, "size": 1.7}]}),
        "negative-memory.json": json.dumps({**base, "maxSizePerFPGA": -5}),
        "list.json": "[1, 2]",
        "deep.json": "[" * 100_000 + "]" * 100_000,
        "empty.json": "",
        "nan-plan.json": json.dumps({**plan, "objective": float("nan")}),
        "no-stages.json": json.dumps({**plan, "stages": []}),
        "twice.json": json.dumps({**plan, "stages": [{"device": "a", "nodes": ["1"]}, {"device": "b", "nodes": ["1"]}]}),
        "cluster-nan.json": json.dumps({"devices": [{"name": "g", "torch_device": "cuda:0", "kind": "cuda",
                                                      "memory": "NaN GiB"}]}),
        "cluster-potato.json": json.dumps({"devices": [{"name": "g", "torch_device": "potato", "kind": "cuda"}]}),
    }
    for name, text in texts.items():
        (tmp / name).write_text(text)
    moirai = (WORKLOADS / "moirai" / "example-1__instances.csv").read_bytes()
    (tmp / "latin.csv").write_bytes(moirai.replace(b",7,6,8,", b",7,\xe9,8,"))
    (tmp / "dir").mkdir(exist_ok=True)
    return {name: str(tmp / name) for name in [*texts, "latin.csv", "dir"]}


# -- the cases ------------------------------------------------------------------------------------------
Case = tuple[str, str, Callable[[], Any]]


def cases(tmp: Path) -> list[Case]:
    """Every case as ``(area, description, thunk)``."""
    f = _bad_files(tmp)
    x = _x()
    out: list[Case] = []

    def add(area: str, what: str, fn: Callable[[], Any]) -> None:
        out.append((area, what, fn))

    # place(): arguments
    add("place", "model is a function", lambda: torchplace.place(lambda v: v, DEVICES, (x,)))
    add("place", "model on the meta device", lambda: torchplace.place(_meta_mlp(), DEVICES, (x,)))
    add("place", "example_inputs is a dict", lambda: _place(_mlp(), {"x": x}))
    add("place", "example_inputs is a string", lambda: _place(_mlp(), "x"))
    add("place", "no example inputs", lambda: _place(_mlp(), ()))
    add("place", "batch of size 0", lambda: _place(_mlp(), (torch.randn(0, 8),)))
    add("place", "wrong feature size", lambda: _place(_mlp(), (torch.randn(6, 9),)))
    add("place", "wrong dtype (int64)", lambda: _place(_mlp(), (torch.ones(6, 8, dtype=torch.long),)))
    add("place", "example_kwargs is a list", lambda: _place(_mlp(), (x,), example_kwargs=[1]))
    for value in (2.5, 0, -1, True, "4", float("nan")):
        add("place", f"microbatches={value!r}", lambda v=value: _place(_mlp(), microbatches=v))
    for value in (float("nan"), float("inf"), -1, 0, "soon"):
        add("place", f"time_limit={value!r}", lambda v=value: _place(_mlp(), time_limit=v))
    add("place", "repeats=0", lambda: _place(_mlp(), repeats=0))
    add("place", "warmup=-1", lambda: _place(_mlp(), warmup=-1))
    add("place", "objective='speed'", lambda: _place(_mlp(), objective="speed"))
    add("place", "granularity='layer'", lambda: _place(_mlp(), granularity="layer"))
    add("place", "trace_method='jit'", lambda: _place(_mlp(), trace_method="jit"))
    add("place", "leaf_modules=['Lineer'] (misspelt)", lambda: _place(_mlp(), leaf_modules=["Lineer"]))
    add("place", "leaf_modules=[3]", lambda: _place(_mlp(), leaf_modules=[3]))
    add("place", "solver='simplex'", lambda: _place(_mlp(), solver="simplex"))
    add("place", "solver='moirai' for throughput", lambda: _place(_mlp(), solver="moirai"))
    add("place", "plan=3", lambda: _place(_mlp(), plan=3))
    add("place", "plan file that does not exist", lambda: _place(_mlp(), plan=str(tmp / "missing.json")))
    add("place", "plan of another model", lambda: _place(_mlp(), plan=_place(_Identity()).plan))
    add("place", "data-dependent control flow", lambda: _place(_Branchy()))
    add("place", "model fixes its batch size, microbatches=3", lambda: _place(_FixedBatch(), microbatches=3))
    add("place", "schedule='gpipe' without mode='training'", lambda: _place(_mlp(), schedule="gpipe"))
    add("place", "buffer counter, microbatches=3", lambda: _place(_Counter(), microbatches=3))
    add("place", "dataclass output (fx), microbatches=3",
        lambda: _place(_ReturnsADataclass(), microbatches=3, trace_method="fx"))
    for devices in ([], ["potato"], ["cuda:7"], ["cpu:0", "cpu:0"], "cpu:0", [3]):
        add("devices", f"devices={devices!r}", lambda d=devices: _place(_mlp(), devices=d))
    for cap in ("lots", -1, float("nan"), "1.5 apples", 10**400):
        add("devices", f"max_memory={{'cpu:0': {cap!r}}}", lambda c=cap: _place(_mlp(), max_memory={"cpu:0": c}))
    add("devices", "max_memory for a device not placed on", lambda: _place(_mlp(), max_memory={"cuda:5": "1GB"}))
    add("devices", "max_memory too small for the model", lambda: _place(_mlp(), max_memory={"cpu:0": 100, "cpu:1": 100}))
    add("devices", "cluster file with NaN memory", lambda: load_cluster(f["cluster-nan.json"]))
    add("devices", "cluster file with device 'potato'", lambda: load_cluster(f["cluster-potato.json"]))

    # valid but unusual inputs: the result must equal eager PyTorch's
    add("valid", "one tensor as example_inputs", lambda: _same(_mlp, lambda: _x()))
    add("valid", "keyword example inputs", lambda: _same_kwargs())
    add("valid", "keyword at its default left out (export)", lambda: _same_default_left_out())
    add("valid", "identity model (no operators)", lambda: _same(_Identity, lambda: (_x(),)))
    add("valid", "relu_ after a read (issue repro)", lambda: _same(_ReluAfterRead, lambda: (_x(),), devices=["cpu:0", "cpu:1", "cpu:2"]))
    add("valid", "model writes its input", lambda: _same(_WritesInput, lambda: (_x(),)))
    add("valid", "buffer counter (self.n += 1)", lambda: _same(_Counter, lambda: (_x(),), calls=3))
    add("valid", "tied embedding / head weight", lambda: _same(_Tied, lambda: (torch.arange(12).reshape(6, 2) % 20,)))
    add("valid", "latency objective, batch of one", lambda: _same(_mlp, lambda: (_x(1),), objective="latency"))
    add("valid", "other batch size at call time", lambda: _other_batch())
    add("valid", "empty batch at call time", lambda: _empty_batch())
    add("valid", "the model returns its input, microbatches=3", _returns_its_input)
    add("valid", "training step, a batch of 10 in 4 micro-batches", _uneven_training_step)
    add("valid", "leaf_modules by class name", lambda: _same(_mlp, lambda: (_x(),), granularity="module",
                                                              leaf_modules=["Linear"]))

    # a placed model
    add("placed", "call without its input", lambda: _placed_mlp()())
    add("placed", "call with an extra input", lambda: _placed_mlp()(x, x))
    add("placed", "call with the wrong feature size", lambda: _placed_mlp()(torch.randn(6, 9)))
    add("placed", "call with float64 input", lambda: _placed_mlp()(x.double()))
    add("placed", "pickle.dumps", lambda: pickle.dumps(_placed_mlp()))
    add("placed", "copy.deepcopy", lambda: copy.deepcopy(_placed_mlp()))
    add("placed", "copy.copy", lambda: copy.copy(_placed_mlp()))
    add("placed", "torch.save", lambda: torch.save(_placed_mlp(), io.BytesIO()))
    add("placed", ".to('cpu')", lambda: _placed_mlp().to("cpu"))
    add("placed", ".half()", lambda: _placed_mlp().half())
    add("placed", ".train()", lambda: _placed_mlp().train())
    add("placed", "load_state_dict(assign=True)", lambda: _load(assign=True))
    add("placed", "load_state_dict of another model", lambda: _placed_mlp().load_state_dict(_Tied().state_dict()))
    add("placed", "load_state_dict of the same model", lambda: _load(assign=False))

    # command line and files
    for name in ("nan-latency.json", "inf-size.json", "huge-size.json", "fraction-fpgas.json", "fraction-size.json",
                 "negative-memory.json", "list.json", "deep.json", "empty.json", "latin.csv", "dir"):
        add("cli", f"solve {name}", lambda n=name: _cli(["solve", f[n]]))
    for name in ("list.json", "deep.json", "empty.json", "nan-plan.json", "no-stages.json", "twice.json"):
        add("cli", f"show {name}", lambda n=name: _cli(["show", f[n]]))
    for option, value in (("--time-limit", "nan"), ("--time-limit", "-1"), ("--ideal-limit", "-5"), ("-o", f["dir"])):
        add("cli", f"solve {option} {Path(value).name}", lambda o=option, v=value: _cli(["solve", str(BERT24), o, v]))
    for option, value in (("--batch", "-2"), ("--microbatches", "2.5"), ("--devices", "potato")):
        add("cli", f"plan mlp {option} {value}", lambda o=option, v=value: _cli(["plan", "mlp", o, v]))
    add("cli", "unknown method", lambda: _cli(["solve", str(BERT24), "--method", "simplex"]))
    add("cli", "solve a Piper workload, --bandwidth-gbs 1e-300",
        lambda: _cli(["solve", str(WORKLOADS / "piper" / "bert32a100.json"), "--method", "piper", "--bandwidth-gbs", "1e-300"]))
    add("cli", "solve a latency workload --ideal-limit 5", lambda: _cli(["solve", str(MOIRAI), "--ideal-limit", "5"]))
    add("cli", "moirai MILP on bert_l-12 operators, --time-limit 5",
        lambda: _cli(["solve", str(BERT12), "--method", "moirai", "--objective", "latency", "--time-limit", "5"]))
    return out


def _meta_mlp() -> nn.Module:
    with torch.device("meta"):
        return nn.Sequential(nn.Linear(8, 8))


class _Scaled(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a = nn.Linear(8, 8)

    def forward(self, x, *, scale=None):
        return self.a(x) * (1.0 if scale is None else scale)


def _same_kwargs() -> None:
    model = _Scaled().eval()
    scale = torch.rand(6, 8)
    placed = _place(model, (_x(),), example_kwargs={"scale": scale})
    with torch.no_grad():
        if not torch.equal(placed(_x(), scale=scale), model(_x(), scale=scale)):
            raise _Wrong("differs from eager PyTorch")


def _same_default_left_out() -> None:
    model = _Scaled().eval()
    placed = _place(model, (_x(),), example_kwargs={"scale": None}, trace_method="export")
    with torch.no_grad():
        if not torch.equal(placed(_x()), model(_x())):
            raise _Wrong("differs from eager PyTorch")


def _other_batch() -> None:
    model = _mlp()
    placed = _place(model, microbatches=2)
    x = torch.randn(10, 8)
    with torch.no_grad():
        if not torch.equal(placed(x), torch.cat([model(x[:5]), model(x[5:])])):
            raise _Wrong("differs from eager PyTorch on the same micro-batches")


def _empty_batch() -> None:
    model = _mlp()
    placed = _place(model, microbatches=2)
    with torch.no_grad():
        if placed(torch.randn(0, 8)).shape != model(torch.randn(0, 8)).shape:
            raise _Wrong("empty batch gives another shape than eager PyTorch")


def _returns_its_input() -> None:
    model = _ReturnsItsInput()
    x = _x()
    placed = _place(model, (x,), microbatches=3)
    with torch.no_grad():
        out, expected = placed(x), model(x)
    if out[1] is not x or not torch.equal(out[0], expected[0]):
        raise _Wrong("the input comes back as a copy, or the output differs from eager PyTorch")


def _uneven_training_step() -> None:
    """A batch of 10 in micro-batches of 3, 3, 2, 2: the gradient of the batch's mean loss."""
    model, reference = _mlp().train(), _mlp().train()
    x, y = torch.randn(10, 8), torch.randn(10, 4)
    loss_fn = nn.functional.mse_loss
    placed = _place(model, (x,), mode="training", microbatches=4, loss_fn=loss_fn, example_target=y)
    placed.step(x, target=y)
    loss_fn(reference(x), y).backward()
    if not all(torch.allclose(p.grad, q.grad, rtol=1e-5, atol=1e-7) for p, q in zip(model.parameters(),
                                                                                    reference.parameters())):
        raise _Wrong("gradients differ from the batch's")


def _load(assign: bool) -> None:
    model, other = _mlp(), nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4)).eval()
    placed = _place(model)
    placed.load_state_dict(other.state_dict(), assign=assign)
    with torch.no_grad():
        if not torch.equal(placed(_x()), other(_x())):
            raise _Wrong("load_state_dict did not reach the placed weights")


def run(case: Case) -> Row:
    """Run one case and classify its outcome."""
    area, what, fn = case
    expect_ok = area == "valid" or what == "load_state_dict of the same model"
    try:
        with contextlib.redirect_stderr(io.StringIO()), torch.random.fork_rng():
            fn()
    except _CliRefused as e:
        return Row(area, what, "refused", f"exit 2: {str(e)[len('torchplace: error: '):][:90]}")
    except _Wrong as e:
        return Row(area, what, "WRONG", str(e))
    except TorchplaceError as e:
        multi = len(str(e).strip().splitlines()) > 1
        outcome = "CRASH" if multi or expect_ok else "refused"
        return Row(area, what, outcome, f"{type(e).__name__}: {str(e).splitlines()[0][:90]}")
    except Exception as e:  # noqa: BLE001 - what the case is about
        return Row(area, what, "CRASH", f"{type(e).__name__}: {str(e).splitlines()[0][:90] if str(e) else ''}")
    return Row(area, what, "ok" if expect_ok else "WRONG", "equal to eager PyTorch" if expect_ok else "accepted")


def run_all() -> list[Row]:
    with tempfile.TemporaryDirectory() as tmp:
        return [run(c) for c in cases(Path(tmp))]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    rows = run_all()
    print(f"torchplace robustness, {date.today()}, {platform.machine()} {os.cpu_count()} cores, torch {torch.__version__}\n")
    print("| area | input | outcome | exception / detail |\n|---|---|---|---|")
    for r in rows:
        print(f"| {r.area} | {r.case} | {r.outcome} | {r.detail.replace('|', '/')} |")
    counts = {k: sum(r.outcome == k for r in rows) for k in ("ok", "refused", "WRONG", "CRASH")}
    print(f"\n{len(rows)} inputs: " + ", ".join(f"{v} {k}" for k, v in counts.items()))
    return 1 if counts["WRONG"] or counts["CRASH"] else 0


if __name__ == "__main__":
    sys.exit(main())
