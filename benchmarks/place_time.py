"""How long ``place()`` takes on real models, per phase, today's path beside the fast one (issue 16 item 4).

Run:  HF_HUB_OFFLINE=1 python benchmarks/place_time.py [--models gpt2-small bert-base ...] [--quick]
                                                         [--paths before exhaustive fast cached] [--threads 1]
                                                         [--base REV]

Each model is built from its transformers config (random weights, nothing downloaded), batch 4,
sequence 128, and placed at operator level on two logical CPUs, ``["cpu:0", "cpu:1"]``, with
``torchplace.place``'s defaults (throughput, 4 micro-batches, ``solver="auto"``) except
``allow_single_device=False`` (the split is what is solved and compared). Three paths, in the same
run, one fresh process each (so peak RSS is that path's own):

* ``before`` -- the library as of ``--base`` (default: where this branch left ``main``),
  extracted with ``git archive`` into a temporary folder, with ``profiling="exhaustive"`` (its
  default until 2026-11-23);
* ``exhaustive`` -- this tree with ``place(..., profiling="exhaustive")``: every operator timed in
  each of ``warmup + repeats`` runs of the whole graph;
* ``fast`` -- this tree's default, ``profiling="fast"``: the nodes of one operator signature
  timed in their places and pooled, with adaptive repeats (:mod:`torchplace.profiling.profile`);
* ``cached`` -- this tree's default, the second ``place()`` of the same model with
  ``profile_cache=`` set: the first call (not timed) fills the cache, the second times nothing.

Columns: nodes of the operator graph; seconds of the whole ``place()`` call and of its phases
(trace, profile, coarsen, solve; ``other`` is the rest: argument checks, the micro-batch decision,
the split into stages); the process's peak RSS (``ru_maxrss``: the model's weights included); the
plan's objective under the cost model (ms per call of the batch, each path on its own profile)
and each plan evaluated on the ``before`` path's profile (``on before's costs``: the DP is optimal
there for the ``before`` plan, so another plan scores at least as much; the excess is what
profiling differences cost the plan).

Phases are timed by wrapping the functions ``place()`` calls (``torchplace.api.trace``,
``profile``, ``fusion.coarsen``, ``solvers.solve``); nothing in the library is changed.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import subprocess
import sys
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]

BATCH, SEQ = 4, 128
PATHS = ("before", "exhaustive", "fast", "cached")


def _gpt2_small(quick: bool) -> tuple[torch.nn.Module, dict[str, Any]]:
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(n_layer=2 if quick else 12, use_cache=False)  # 768 wide, 12 heads
    return GPT2LMHeadModel(config), {"input_ids": torch.randint(0, config.vocab_size, (BATCH, SEQ))}


def _bert_base(quick: bool) -> tuple[torch.nn.Module, dict[str, Any]]:
    from transformers import BertConfig, BertModel

    config = BertConfig(num_hidden_layers=2 if quick else 12, attn_implementation="eager")
    return BertModel(config, add_pooling_layer=False), {"input_ids": torch.randint(0, config.vocab_size, (BATCH, SEQ))}


def _t5_small(quick: bool) -> tuple[torch.nn.Module, dict[str, Any]]:
    from transformers import T5Config, T5ForConditionalGeneration

    layers = 1 if quick else 6
    config = T5Config(d_model=512, d_ff=2048, d_kv=64, num_heads=8, num_layers=layers, num_decoder_layers=layers,
                      use_cache=False)
    ids = torch.randint(0, config.vocab_size, (BATCH, SEQ))
    return T5ForConditionalGeneration(config), {"input_ids": ids, "decoder_input_ids": ids.clone()}


def _llama8(quick: bool) -> tuple[torch.nn.Module, dict[str, Any]]:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=8192, hidden_size=512, intermediate_size=1408,
                         num_hidden_layers=2 if quick else 8, num_attention_heads=8, num_key_value_heads=4,
                         max_position_embeddings=256, use_cache=False)
    return LlamaForCausalLM(config), {"input_ids": torch.randint(0, config.vocab_size, (BATCH, SEQ))}


def _whisper_tiny(quick: bool) -> tuple[torch.nn.Module, dict[str, Any]]:
    from transformers import WhisperConfig, WhisperForConditionalGeneration

    # whisper-tiny's widths; the encoder takes 2 x max_source_positions mel frames: 128 frames here
    layers = 1 if quick else 4
    config = WhisperConfig(d_model=384, encoder_layers=layers, decoder_layers=layers, encoder_attention_heads=6,
                           decoder_attention_heads=6, encoder_ffn_dim=1536, decoder_ffn_dim=1536,
                           max_source_positions=SEQ // 2, use_cache=False)
    return WhisperForConditionalGeneration(config), {
        "input_features": torch.randn(BATCH, config.num_mel_bins, SEQ),
        "decoder_input_ids": torch.randint(0, config.vocab_size, (BATCH, SEQ)),
    }


MODELS = {"gpt2-small": _gpt2_small, "bert-base": _bert_base, "t5-small": _t5_small, "llama-8": _llama8,
          "whisper-tiny": _whisper_tiny}


def _timed(phases: dict[str, float], name: str, fn: Any) -> Any:
    """``fn`` adding its seconds to ``phases[name]`` (outermost calls only: a solver may call ``solve``)."""
    depth = [0]

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        t0 = time.perf_counter()
        depth[0] += 1
        try:
            return fn(*args, **kwargs)
        finally:
            depth[0] -= 1
            if depth[0] == 0:
                phases[name] = phases.get(name, 0.0) + time.perf_counter() - t0

    return wrapper


def measure(name: str, path: str, quick: bool, profile_path: str | None) -> dict[str, Any]:
    """One ``place()`` of ``name`` on ``path``, in this process: phase seconds, peak RSS, objective."""
    import torchplace
    from torchplace import api, fusion, solvers
    from torchplace.costmodel import evaluate
    from torchplace.graph import OpGraph

    torch.manual_seed(0)
    model, kwargs = MODELS[name](quick)
    model.eval()
    phases: dict[str, float] = {}
    api.trace = _timed(phases, "trace", api.trace)
    api.profile = _timed(phases, "profile", api.profile)
    fusion.coarsen = _timed(phases, "coarsen", fusion.coarsen)
    solvers.solve = _timed(phases, "solve", solvers.solve)
    options: dict[str, Any] = {"profiling": "fast" if path in ("fast", "cached") else "exhaustive"}
    if path == "cached":  # a second place() of the same model: the first fills the profile cache
        import tempfile

        options["profile_cache"] = tempfile.mkdtemp(prefix="torchplace-profiles-")
        torchplace.place(model, ["cpu:0", "cpu:1"], example_kwargs=kwargs, progress=False,
                         allow_single_device=False, **options)
        phases.clear()
    t0 = time.perf_counter()
    placed = torchplace.place(model, ["cpu:0", "cpu:1"], example_kwargs=kwargs, progress=False,
                              allow_single_device=False, **options)
    total = time.perf_counter() - t0
    problem, plan = placed.problem, placed.plan
    row = {"model": name, "path": path, "nodes": len(problem.graph), "total": total, **phases,
           "peak_rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
           "objective": plan.objective, "solver": plan.solver, "stages": len(plan.stages),
           "graph": problem.graph.to_json(), "assignment": [list(s.nodes) for s in plan.stages],
           "devices": [s.device for s in plan.stages]}
    if profile_path:  # this plan on another path's costs
        import dataclasses

        other = OpGraph.from_json(json.loads(Path(profile_path).read_text()))
        row["on_other"] = evaluate(dataclasses.replace(problem, graph=other), plan)
    return row


def _child(name: str, path: str, quick: bool, threads: int, out: Path, other: Path | None, root: Path) -> dict[str, Any]:
    cmd = [sys.executable, __file__, "--child", name, path, str(out), "--threads", str(threads), "--root", str(root)]
    if quick:
        cmd.append("--quick")
    if other is not None:
        cmd += ["--other", str(other)]
    subprocess.run(cmd, check=True)
    return json.loads(out.read_text())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    ap.add_argument("--paths", nargs="+", default=list(PATHS), choices=list(PATHS))
    ap.add_argument("--quick", action="store_true", help="fewer layers per model (a smoke run)")
    ap.add_argument("--threads", type=int, default=1, help="torch intra-op threads (default 1)")
    ap.add_argument("--base", help="git revision of the 'before' path (default: merge-base of HEAD and main)")
    ap.add_argument("--child", nargs=3, help=argparse.SUPPRESS)
    ap.add_argument("--other", help=argparse.SUPPRESS)
    ap.add_argument("--root", help=argparse.SUPPRESS)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    sys.path.insert(0, args.root or str(ROOT))
    if args.child:
        name, path, out = args.child
        row = measure(name, path, args.quick, args.other)
        Path(out).write_text(json.dumps(row))
        return
    import tempfile

    def git(*a: str) -> str:
        return subprocess.run(["git", "-C", str(ROOT), *a], check=True, capture_output=True, text=True).stdout.strip()

    base = git("rev-parse", "--short", args.base or git("merge-base", "HEAD", "main"))
    head = git("rev-parse", "--short", "HEAD") + ("+" if git("status", "--porcelain", "torchplace") else "")
    stamp = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    print(f"{stamp}; {platform.machine()}, nproc {os.cpu_count()}, load average {os.getloadavg()[0]:.2f}, "
          f"torch {torch.__version__}, {args.threads} intra-op thread(s); batch {BATCH}, sequence {SEQ}; "
          f"place(model, ['cpu:0', 'cpu:1']) at operator level{' (--quick)' if args.quick else ''}; "
          f"before = {base}, this tree = {head}\n")
    print("| model | path | nodes | place() s | trace s | profile s | coarsen s | solve s | other s | peak RSS GiB "
          "| objective ms | on before's costs ms | solver |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    with tempfile.TemporaryDirectory() as tmp:
        old_root = Path(tmp, "before")
        if "before" in args.paths:
            old_root.mkdir()
            archive = subprocess.run(["git", "-C", str(ROOT), "archive", base, "torchplace"], check=True,
                                     capture_output=True).stdout
            subprocess.run(["tar", "-x", "-C", str(old_root)], input=archive, check=True)
        for name in args.models:
            graph_file = None
            for path in args.paths:
                out = Path(tmp, f"{name}-{path}.json")
                root = old_root if path == "before" else ROOT
                row = _child(name, path, args.quick, args.threads, out, graph_file, root)
                if path == "before":
                    graph_file = Path(tmp, f"{name}-graph.json")
                    graph_file.write_text(json.dumps(row["graph"]))
                    row["on_other"] = row["objective"]
                known = sum(row.get(p, 0.0) for p in ("trace", "profile", "coarsen", "solve"))
                on_other = f"{row['on_other'] * 1e3:.2f}" if "on_other" in row else "-"
                print(f"| {name} | {path} | {row['nodes']} | {row['total']:.1f} | {row.get('trace', 0):.1f} "
                      f"| {row.get('profile', 0):.1f} | {row.get('coarsen', 0):.1f} | {row.get('solve', 0):.1f} "
                      f"| {row['total'] - known:.1f} | {row['peak_rss'] / 2**30:.2f} | {row['objective'] * 1e3:.2f} "
                      f"| {on_other} | {row['solver']} |", flush=True)


if __name__ == "__main__":
    main()
