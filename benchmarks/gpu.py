"""On a real GPU: exactness of cuda + cpu placements, throughput, copy/compute overlap, cost-model fidelity.

Run (on a machine with a CUDA device):  HF_HUB_OFFLINE=1 python benchmarks/gpu.py --out DIR

Sections (each guarded, so one failure does not hide the others; results go to ``DIR/gpu.json``
and a markdown report to ``DIR/gpu.md``):

1. **exactness**: GPT-2 (transformers, random weights), the residual CNN and the Inception-style
   CNN placed on ``[GPU, "cpu"]`` for both objectives, contiguous and not, with the GPU capped
   (``max_memory``) so the model must split; outputs compared with the unplaced model on the CPU
   (TF32 off; fp32 kernels on the GPU round differently from the CPU's, so the check is
   ``allclose`` with the tolerance printed) and with the same stages run one after another on the
   same devices without the executor (bitwise: the executor must not change a single bit). Training:
   one 1F1B step of the residual CNN on cuda:0 + cpu, gradients against the unsplit model's.
2. **throughput** (the demo's table): GPT-2 small (124M parameters) with the GPU capped below the
   model's size: the placed pipeline beside the whole model on the GPU alone, the model on the CPU,
   and accelerate's ``infer_auto_device_map`` + ``dispatch_model`` split under the same cap.
3. **overlap**: a ``torch.profiler`` trace of one pipelined call (written as ``overlap_trace.json``,
   Chrome / Perfetto format) and the share of copy time that ran while a kernel ran on another
   stream.
4. **fidelity**: per stage, the cost model's predicted compute time (CUDA-event profiling) beside
   the stage's measured time on its device (CUDA events / wall clock, median of repeats), over
   several plans; Pearson correlation and median relative error.
"""
from __future__ import annotations

import argparse
import copy
import json
import math
import os
import platform
import statistics
import subprocess
import time
import traceback
from collections.abc import Callable
from datetime import date
from pathlib import Path
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch import nn

import torchplace
from torchplace import costmodel
from torchplace.demo import samples_per_second
from torchplace.models import InceptionCNN, ResidualCNN
from torchplace.runtime.graph_io import GraphIO

QUICK = {"progress": False, "repeats": 3, "warmup": 1, "time_limit": 20}
SMALL = False  # ``--small``: tiny models, to check the script quickly
GPU = "cuda:0"  # ``--dry-run`` replaces it with a logical CPU to check this script where there is no GPU
RTOL, ATOL = 1e-4, 1e-4


def _gpt2(layers: int, width: int, heads: int, vocab: int, batch: int, seq: int):
    if SMALL:
        layers, width, heads, vocab, batch, seq = 2, 64, 2, 512, 4, 16
    from transformers import GPT2Config, GPT2LMHeadModel
    from transformers.models.gpt2.modeling_gpt2 import GPT2Block

    torch.manual_seed(0)
    config = GPT2Config(n_layer=layers, n_embd=width, n_head=heads, vocab_size=vocab, n_positions=max(seq, 64),
                        use_cache=False, bos_token_id=vocab - 1, eos_token_id=vocab - 1)
    model = GPT2LMHeadModel(config).eval()
    ids = torch.randint(0, vocab, (batch, seq), generator=torch.Generator().manual_seed(1))
    return model, (ids,), {"granularity": "module", "leaf_modules": [GPT2Block]}


def _cnn(kind: str, batch: int):
    torch.manual_seed(0)
    model = (ResidualCNN((32, 64, 64, 128)) if kind == "resnet" else InceptionCNN(32)).eval()
    batch = 4 if SMALL else batch
    return model, (torch.randn(batch, 3, 32, 32, generator=torch.Generator().manual_seed(1)),), {}


def _param_bytes(model: nn.Module) -> int:
    return sum(t.numel() * t.element_size() for t in [*model.parameters(), *model.buffers()])


def _leaves(x: Any) -> list[torch.Tensor]:
    return [t for t in pytree.tree_leaves(x) if isinstance(t, torch.Tensor)]


def _max_diff(a: Any, b: Any) -> float:
    return max((float((x.detach().cpu().float() - y.detach().cpu().float()).abs().max()) for x, y in
                zip(_leaves(a), _leaves(b))), default=0.0)


def _bitwise(a: Any, b: Any) -> bool:
    xs, ys = _leaves(a), _leaves(b)
    return len(xs) == len(ys) and all(torch.equal(x.detach().cpu(), y.detach().cpu()) for x, y in zip(xs, ys))


def _sequential(placed: Any, args: tuple[Any, ...], timer: dict[int, list[float]] | None = None) -> Any:
    """Run the placed model's stages one after another on their devices, without the executor.

    The reference for "the executor changes no bit": same stage modules, same devices, no threads,
    no streams. With ``timer``, each stage's time (CUDA events on a GPU, wall clock on the CPU) is
    appended to ``timer[index]``.
    """
    if placed.microbatches > 1:
        from torchplace.runtime.microbatch import gather, scatter

        return gather([_sequential(_Whole(placed), a, timer) for a, _ in scatter(args, {}, placed.microbatches)])
    io = GraphIO(placed._traced.gm)
    env = dict(io.bind_inputs(args, {}))
    for stage, name in zip(placed.stage_modules, placed._torch_devices):
        device = torch.device(name)
        inputs = [pytree.tree_map_only(torch.Tensor, lambda t: t.to(device), env[n]) for n in stage.inputs]
        if device.type == "cuda":
            torch.cuda.synchronize()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            out = stage(*inputs)
            end.record()
            torch.cuda.synchronize()
            seconds = start.elapsed_time(end) / 1e3
        else:
            t0 = time.perf_counter()
            out = stage(*inputs)
            seconds = time.perf_counter() - t0
        if timer is not None:
            timer.setdefault(stage.index, []).append(seconds)
        env.update(zip(stage.outputs, out))
    return io(env)


class _Whole:
    """A placed model seen with one micro-batch (``_sequential`` runs it per micro-batch)."""

    def __init__(self, placed: Any) -> None:
        self._placed = placed

    def __getattr__(self, name: str) -> Any:
        return 1 if name == "microbatches" else getattr(self._placed, name)


def _where(placed: Any) -> str:
    return " ".join(f"{s.device}x{len(s.nodes)}" for s in placed.plan.stages)


def exactness(report: dict[str, Any]) -> None:
    rows = report.setdefault("exactness", [])
    builds: dict[str, Callable[[], Any]] = {
        "gpt2": lambda: _gpt2(4, 256, 4, 2048, 8, 64),
        "resnet": lambda: _cnn("resnet", 16),
        "inception": lambda: _cnn("inception", 16),
    }
    for name, build in builds.items():
        for objective in ("throughput", "latency"):
            for contiguous in (True, False):
                row: dict[str, Any] = {"model": name, "objective": objective, "contiguous": contiguous}
                rows.append(row)
                try:
                    model, inputs, options = build()
                    reference = copy.deepcopy(model)
                    cap = int(0.5 * _param_bytes(model))
                    placed = torchplace.place(model, [GPU, "cpu"], inputs, objective=objective, allow_single_device=False,
                                              contiguous=contiguous, max_memory={GPU: cap}, microbatches=4,
                                              **options, **QUICK)
                    with torch.no_grad():
                        out = placed(*inputs)
                        ref = reference(*inputs)
                        seq = _sequential(placed, inputs)
                    row.update(plan=_where(placed), solver=placed.plan.solver, status=placed.plan.status,
                               max_diff=_max_diff(out, ref),
                               allclose=all(torch.allclose(x.cpu(), y, rtol=RTOL, atol=ATOL)
                                            for x, y in zip(_leaves(out), _leaves(ref))),
                               bitwise_vs_sequential=_bitwise(out, seq))
                except Exception as e:  # noqa: BLE001 - recorded, the run goes on
                    row["error"] = f"{type(e).__name__}: {e}"[:500]
                    row["traceback"] = traceback.format_exc()[-3000:]
                print(row, flush=True)
    # training: one 1F1B step, gradients against the unsplit model's
    row = {"model": "resnet", "objective": "training 1f1b", "contiguous": True}
    rows.append(row)
    try:
        torch.manual_seed(0)
        model = ResidualCNN((16, 32, 32)).train()
        reference = copy.deepcopy(model)
        x = torch.randn(16, 3, 32, 32, generator=torch.Generator().manual_seed(2))
        y = torch.randint(0, 10, (16,), generator=torch.Generator().manual_seed(3))
        placed = torchplace.place(model, [GPU, "cpu"], (x,), mode="training", microbatches=4, allow_single_device=False,
                                  max_memory={GPU: int(0.6 * _param_bytes(model))}, **QUICK)
        loss_fn = nn.functional.cross_entropy
        losses = placed.step(x, target=y, loss_fn=loss_fn)
        ref_losses = []
        for xs, ys in zip(x.chunk(4), y.chunk(4)):
            loss = loss_fn(reference(xs), ys) / 4
            loss.backward()
            ref_losses.append(loss.detach() * 4)
        grad_diff = max(float((p.grad.cpu() - q.grad).abs().max()) for p, q in
                        zip(model.parameters(), reference.parameters()))
        row.update(plan=_where(placed), max_diff=grad_diff,
                   loss_diff=max(abs(float(a) - float(b)) for a, b in zip(losses, ref_losses)),
                   allclose=all(torch.allclose(p.grad.cpu(), q.grad, rtol=1e-3, atol=1e-4)
                                for p, q in zip(model.parameters(), reference.parameters())),
                   on_gpu=sum(p.is_cuda for p in model.parameters()))
    except Exception as e:  # noqa: BLE001
        row["error"] = f"{type(e).__name__}: {e}"[:500]
        row["traceback"] = traceback.format_exc()[-3000:]
    print(row, flush=True)


def throughput(report: dict[str, Any]) -> None:
    rows = report.setdefault("throughput", [])
    model, inputs, options = _gpt2(12, 768, 12, 50257, 8, 256)
    size = _param_bytes(model)
    cap = int(0.6 * size)
    report["throughput_setup"] = {"model": "GPT-2 small (12 layers, d=768, vocab 50257, random weights)",
                                  "batch": list(inputs[0].shape), "param_bytes": size, "gpu_cap": cap}
    batch = inputs[0].shape[0]

    def rate(fn: Callable[[], Any]) -> float:
        return samples_per_second(fn, batch, seconds=2.0, warmup=2)

    with torch.no_grad():
        cpu_model = copy.deepcopy(model)
        rows.append({"what": "whole model on the CPU", "samples_per_s": rate(lambda: cpu_model(*inputs))})
        target = "cuda" if GPU.startswith("cuda") else "cpu"
        gpu_model = copy.deepcopy(model).to(target)
        gpu_in = tuple(t.to(target) for t in inputs)
        rows.append({"what": f"whole model on {GPU} (no cap)", "samples_per_s": rate(lambda: gpu_model(*gpu_in))})
        ref = gpu_model(*gpu_in)
        del gpu_model
        if target == "cuda":
            torch.cuda.empty_cache()
    for m in (1, 4, 8):
        row: dict[str, Any] = {"what": f"torchplace pipeline, m={m}"}
        rows.append(row)
        try:
            placed = torchplace.place(copy.deepcopy(model), [GPU, "cpu"], inputs, microbatches=m, allow_single_device=False,
                                      max_memory={GPU: cap}, **options, **QUICK)
            with torch.no_grad():
                row["samples_per_s"] = rate(lambda: placed(*inputs))
                row["max_diff_vs_gpu"] = _max_diff(placed(*inputs), ref)
            row.update(plan=_where(placed), predicted_s_per_batch=placed.plan.objective,
                       bound=placed.plan.lower_bound, costs=[(c.device, c.compute, c.transfer_in + c.transfer_out, c.memory)
                                                             for c in placed.plan.costs])
            if m == 4:
                report["_placed_for_overlap"], report["_inputs_for_overlap"] = placed, inputs
        except Exception as e:  # noqa: BLE001
            row["error"] = f"{type(e).__name__}: {e}"[:500]
            row["traceback"] = traceback.format_exc()[-3000:]
        print(row, flush=True)
    row = {"what": "accelerate infer_auto_device_map + dispatch_model (same cap)"}
    rows.append(row)
    try:
        from accelerate import dispatch_model, infer_auto_device_map

        acc = copy.deepcopy(model)
        device_map = infer_auto_device_map(acc, max_memory={0: cap, "cpu": 64 * 2**30},
                                           no_split_module_classes=["GPT2Block"])
        acc = dispatch_model(acc, device_map)
        with torch.no_grad():
            row["samples_per_s"] = rate(lambda: acc(*gpu_in))
        row["plan"] = f"{sum(v == 0 for v in device_map.values())} entries on cuda:0, " \
                      f"{sum(v == 'cpu' for v in device_map.values())} on cpu"
    except Exception as e:  # noqa: BLE001
        row["error"] = f"{type(e).__name__}: {e}"[:500]
    print(row, flush=True)


def overlap(report: dict[str, Any], out: Path) -> None:
    placed = report.pop("_placed_for_overlap", None)
    if placed is None:
        report["overlap"] = {"error": "no placed model from the throughput section"}
        return
    from torch.profiler import ProfilerActivity, profile

    model_inputs = report["_inputs_for_overlap"]
    report.pop("_inputs_for_overlap", None)
    with torch.no_grad():
        placed(*model_inputs)
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            placed(*model_inputs)
            torch.cuda.synchronize()
    path = out / "overlap_trace.json"
    prof.export_chrome_trace(str(path))
    events = json.loads(path.read_text())["traceEvents"]
    gpu = [e for e in events if e.get("ph") == "X" and e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]
    kernels = [(e["ts"], e["ts"] + e["dur"], e.get("tid")) for e in gpu if e["cat"] == "kernel"]
    copies = [(e["ts"], e["ts"] + e["dur"], e.get("tid"), e["name"]) for e in gpu if e["cat"] == "gpu_memcpy"]
    overlapped = 0.0
    for s, t, stream, _ in copies:
        spans = sorted((max(s, a), min(t, b)) for a, b, k in kernels if k != stream and a < t and b > s)
        covered, end = 0.0, s
        for a, b in spans:
            a = max(a, end)
            if b > a:
                covered, end = covered + b - a, b
        overlapped += covered
    total = sum(t - s for s, t, _, _ in copies)
    report["overlap"] = {
        "trace": path.name, "streams_with_kernels": len({k for _, _, k in kernels}),
        "copies": len(copies), "copy_us": total, "copy_us_overlapped_with_kernels_on_other_streams": overlapped,
        "overlap_share": overlapped / total if total else None,
        "copy_kinds": sorted({n for *_, n in copies})[:6],
        "kernel_us": sum(b - a for a, b, _ in kernels),
    }
    print(report["overlap"], flush=True)


def fidelity(report: dict[str, Any]) -> None:
    rows = report.setdefault("fidelity", [])
    cases: list[tuple[str, Callable[[], Any], float]] = []
    for frac in (0.3, 0.6):
        cases.append((f"gpt2-small cap {frac}", lambda: _gpt2(12, 768, 12, 50257, 8, 256), frac))
        cases.append((f"gpt2-medium-ish cap {frac}", lambda: _gpt2(8, 1024, 16, 8192, 8, 256), frac))
    for frac in (0.3, 0.6):
        cases.append((f"resnet cap {frac}", lambda: _cnn("resnet", 64), frac))
        cases.append((f"inception cap {frac}", lambda: _cnn("inception", 64), frac))
    for label, build, frac in cases:
        try:
            model, inputs, options = build()
            placed = torchplace.place(model, [GPU, "cpu"], inputs, microbatches=1, allow_single_device=False,
                                      max_memory={GPU: int(frac * _param_bytes(model))}, **options, **QUICK)
            timer: dict[int, list[float]] = {}
            with torch.no_grad():
                for _ in range(7):
                    _sequential(placed, inputs, timer)
            problem = placed.problem
            for stage, spec in zip(placed.stage_modules, placed.plan.stages):
                device = problem.cluster.device(spec.device)
                predicted = costmodel.device_cost(problem, spec.nodes, device).compute
                measured = statistics.median(timer[stage.index][2:])
                rows.append({"case": label, "stage": stage.index, "device": spec.device, "nodes": len(spec.nodes),
                             "predicted_ms": predicted * 1e3, "measured_ms": measured * 1e3})
                print(rows[-1], flush=True)
        except Exception as e:  # noqa: BLE001
            rows.append({"case": label, "error": f"{type(e).__name__}: {e}"[:500],
                         "traceback": traceback.format_exc()[-3000:]})
            print(rows[-1], flush=True)
    pairs = [(r["predicted_ms"], r["measured_ms"]) for r in rows if "predicted_ms" in r]
    if len(pairs) >= 3:
        import numpy as np

        p, m = np.array(pairs).T
        report["fidelity_summary"] = {
            "stages": len(pairs), "pearson": float(np.corrcoef(p, m)[0, 1]),
            "pearson_log": float(np.corrcoef(np.log(p), np.log(m))[0, 1]),
            "median_rel_error": float(np.median(np.abs(p - m) / m)),
            "gpu_median_rel_error": float(np.median([abs(a - b) / b for (a, b), r in
                                                     zip(pairs, [r for r in rows if "predicted_ms" in r])
                                                     if r["device"].startswith("cuda")] or [math.nan])),
        }
        print(report["fidelity_summary"], flush=True)


def _markdown(report: dict[str, Any]) -> str:
    env = report["env"]
    lines = [f"GPU run {env['date']}: {env['gpu']}, driver {env['driver']}, torch {env['torch']} "
             f"(CUDA {env['cuda']}), {env['cpus']} CPU cores", ""]
    lines += ["| model | objective | contiguous | plan (device x nodes, per stage) | max abs diff vs CPU model | allclose "
              f"(rtol {RTOL}, atol {ATOL}) | bitwise vs same stages run sequentially |", "|---|---|---|---|---|---|---|"]
    for r in report.get("exactness", []):
        if "error" in r:
            lines.append(f"| {r['model']} | {r['objective']} | {r['contiguous']} | ERROR {r['error'][:120]} | | | |")
        else:
            lines.append(f"| {r['model']} | {r['objective']} | {r['contiguous']} | {r.get('plan')} | "
                         f"{r['max_diff']:.2e} | {r.get('allclose')} | {r.get('bitwise_vs_sequential', '-')} |")
    lines += ["", f"Throughput: {report.get('throughput_setup')}", "", "| run | samples/s | plan | predicted s/batch |",
              "|---|---|---|---|"]
    for r in report.get("throughput", []):
        lines.append(f"| {r['what']} | {r.get('samples_per_s', float('nan')):.1f} | {r.get('plan', r.get('error', ''))} | "
                     f"{r.get('predicted_s_per_batch', '')} |")
    lines += ["", f"Overlap: {report.get('overlap')}", "", f"Fidelity: {report.get('fidelity_summary')}", "",
              "| case | stage | device | nodes | predicted ms | measured ms |", "|---|---|---|---|---|---|"]
    for r in report.get("fidelity", []):
        if "error" in r:
            lines.append(f"| {r['case']} | ERROR {r['error'][:120]} | | | | |")
        else:
            lines.append(f"| {r['case']} | {r['stage']} | {r['device']} | {r['nodes']} | {r['predicted_ms']:.3f} | "
                         f"{r['measured_ms']:.3f} |")
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("."))
    parser.add_argument("--dry-run", action="store_true", help="no GPU: a logical CPU stands in for cuda:0")
    parser.add_argument("--small", action="store_true", help="smaller models (for --dry-run)")
    parser.add_argument("--sections", nargs="*", default=["exactness", "throughput", "overlap", "fidelity"])
    args = parser.parse_args()
    global GPU, SMALL
    SMALL = args.small
    if args.dry_run:
        GPU = "cpu:1"
        args.sections = [s for s in args.sections if s != "overlap"]
    elif not torch.cuda.is_available():
        print("benchmarks/gpu.py needs a CUDA device (or --dry-run)")
        return 2
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    args.out.mkdir(parents=True, exist_ok=True)
    try:
        driver = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                                capture_output=True, text=True, timeout=30).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        driver = "?"
    report: dict[str, Any] = {"env": {"date": str(date.today()), "gpu": torch.cuda.get_device_name(0) if not args.dry_run else "none (dry run)", "driver": driver,
                                      "torch": torch.__version__, "cuda": torch.version.cuda,
                                      "cpus": os.cpu_count(), "python": platform.python_version()}}
    sections = {"exactness": lambda: exactness(report), "throughput": lambda: throughput(report),
                "overlap": lambda: overlap(report, args.out), "fidelity": lambda: fidelity(report)}
    for name in args.sections:
        t0 = time.perf_counter()
        try:
            sections[name]()
        except Exception as e:  # noqa: BLE001
            report[f"{name}_error"] = traceback.format_exc()[-3000:]
            print(f"section {name} failed: {e}", flush=True)
        report.setdefault("section_seconds", {})[name] = time.perf_counter() - t0
        (args.out / "gpu.json").write_text(json.dumps({k: v for k, v in report.items() if not k.startswith("_")},
                                                      indent=1, default=str))
        (args.out / "gpu.md").write_text(_markdown(report))
    print(_markdown(report))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
