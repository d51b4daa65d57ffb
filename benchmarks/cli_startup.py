"""Whole-process time of ``torchplace solve W --method dp --json`` beside the authors' C++ DP.

Run:  python benchmarks/cli_startup.py [--repeats 3] [--only bert24_inference]

Both sides are timed as a user sees them: a fresh process that starts, reads the workload file,
solves it exactly and prints the plan (best of ``--repeats`` wall-clock runs, side by side in one
run, so a busy machine slows both). The C++ (shared/tools/dnn-partitioning-dp, Tarnawski et al.
2020's published DP) is built from there with its documented line into a temporary directory and
never copied into the project; without g++ its column says why. Issue 16's goal: under 0.6 s for
LayerGraphs/bert24_inference.json, and faster than the C++ on every workload with over 1,000 ideals.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from datetime import date
from pathlib import Path

SHARED = Path(__file__).resolve().parents[1].parent / "shared"
ROOT = SHARED / "workloads" / "dnn-partitioning" / "throughput"
CPP = SHARED / "tools" / "dnn-partitioning-dp"
WORKLOADS = [
    "LayerGraphs/bert24_inference.json", "LayerGraphs/bert24_training.json",
    "LayerGraphs/resnet50_inference.json", "LayerGraphs/resnet50_training.json",
    "OperatorGraphs/resnet50_inference.json", "OperatorGraphs/resnet50_training.json",
    "OperatorGraphs/bert_l-3_inference.json", "OperatorGraphs/bert_l-6_inference.json",
    "OperatorGraphs/bert_l-12_inference.json", "OperatorGraphs/bert_l-3_training.json",
    "OperatorGraphs/bert_l-6_training.json", "OperatorGraphs/bert_L-12_training.json",
]


def build_cpp(out_dir: Path) -> Path | str:
    """The authors' DP built with its README's line (g++ -O2 -std=c++17) in ``out_dir``, or why not."""
    if shutil.which("g++") is None:
        return "no g++"
    exe = out_dir / "dp"
    r = subprocess.run(["g++", "-O2", "-std=c++17", "throughput-dp/dp.cpp", "-o", str(exe)], cwd=CPP,
                       capture_output=True, text=True, check=False)
    return exe if r.returncode == 0 else f"build failed: {r.stderr.strip()[:80]}"


def best_of(cmd: list[str], repeats: int, stdin: Path | None = None) -> tuple[float, str]:
    """Best wall-clock seconds of ``repeats`` runs of ``cmd`` and the last run's stdout."""
    best, out = float("inf"), ""
    for _ in range(repeats):
        with open(stdin or os.devnull, "rb") as f:
            t0 = time.perf_counter()
            r = subprocess.run(cmd, stdin=f, capture_output=True, check=True)
            best = min(best, time.perf_counter() - t0)
        out = r.stdout.decode()
    return best, out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--cpp-repeats", type=int, default=1, help="runs of the C++ (it takes up to ~35 s)")
    ap.add_argument("--only", default="", help="only workloads whose path contains this")
    args = ap.parse_args()
    env_cmd = [sys.executable, "-m", "torchplace", "solve"]
    print(f"# Whole-process `torchplace solve --method dp --json` vs the authors' C++ — {date.today()}, "
          f"{platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}\n")
    with tempfile.TemporaryDirectory() as tmp:
        exe = build_cpp(Path(tmp))
        print("| workload | objective | torchplace s (process) | C++ s (process) | C++ objective | speed-up |")
        print("|---|---|---|---|---|---|")
        for name in (w for w in WORKLOADS if args.only in w):
            path = ROOT / name
            ours, out = best_of([*env_cmd, str(path), "--method", "dp", "--json"], args.repeats)
            objective = json.loads(out)["objective"]
            if isinstance(exe, Path):
                cpp, cpp_out = best_of([str(exe)], args.cpp_repeats, stdin=path)
                cpp_obj, cpp_s, speed = f"{json.loads(cpp_out)['maxLoad']:.6g}", f"{cpp:.3f}", f"{cpp / ours:.2f}x"
            else:
                cpp_obj, cpp_s, speed = "-", exe, "-"
            print(f"| {name} | {objective:.6g} | {ours:.3f} | {cpp_s} | {cpp_obj} | {speed} |", flush=True)


if __name__ == "__main__":
    main()
