"""Cold first plans of the VLM catalogue rows on two trees, run alternately: wall time, traces, same answer.

A change to how fits are traced or searched should give the same answers faster. This runs each row cold
(a fresh process, an empty `HF_MEMFIT_CACHE`) with the tree in `--before DIR` (a checkout of the commit
before, put first on `PYTHONPATH`) and with this tree, `--repeat` times in alternation, and compares the
JSON answers (plan, estimate, runners-up). Wall time, and CPU time: the plan's process and every child it
forked (less noisy than wall time where the machine is shared).

    git worktree add /tmp/before/tree c83daaa
    PYTHONPATH=$PWD python benchmarks/cold_before_after.py --before /tmp/before/tree smolvlm qwen2.5-vl-7b
        # -> results/cold_before_after.json (rows replaced by name)

Rows are `lazy_grid.py`'s and `cold_catalogue.py`'s. Run it on an otherwise idle machine.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
import cold_catalogue  # noqa: E402 - its rows
import lazy_grid  # noqa: E402 - its rows

# Text models whose layers come in kinds with a long period (Gemma-3's 5 sliding : 1 global, SmolLM3's NoPE layer
# every fourth): traced by kinds since 2026-11-27 (`models/depths.py`), fitted by parametric.py.
TEXT_BY_KINDS = {
    "gemma-3-12b-text": ["google/gemma-3-12b-pt", "--gpu", "a100", "--global-batch-size", "32", "--seq-len", "2048"],
    "smollm3-3b": ["HuggingFaceTB/SmolLM3-3B", "--gpu", "a10g", "--global-batch-size", "32", "--seq-len", "2048"],
}
# VLM plans on several GPUs, whose grids add FSDP layouts (which read the plain step's fits since 2026-11-27).
MULTI_GPU = {
    "smolvlm-2xa10g": ["HuggingFaceTB/SmolVLM-Instruct", "--gpu", "a10g", "--num-gpus", "2", "--global-batch-size",
                       "32", "--task", "image-text-to-text", "--seq-len", "512"],
    "qwen2.5-vl-7b-4xa100": ["Qwen/Qwen2.5-VL-7B-Instruct", "--gpu", "a100", "--num-gpus", "4", "--global-batch-size",
                             "32", "--task", "image-text-to-text", "--seq-len", "512"],
}
ROWS = {**lazy_grid.ROWS, **cold_catalogue.ROWS, **TEXT_BY_KINDS, **MULTI_GPU}
RESULTS = Path(__file__).parent / "results" / "cold_before_after.json"
HERE = Path(__file__).resolve().parent.parent


def run(args: list[str], tree: Path) -> dict:
    cache = tempfile.mkdtemp(prefix="memfit_cold_")
    code = "from hf_memfit.cli.main import run; run()"  # as the `hf-memfit` command runs
    started, children = time.perf_counter(), resource.getrusage(resource.RUSAGE_CHILDREN)
    done = subprocess.run([sys.executable, "-c", code, "plan", *args, "--json"], capture_output=True, text=True,
                          env={**os.environ, "HF_MEMFIT_CACHE": cache, "PYTHONPATH": str(tree)}, cwd=tree)
    wall = time.perf_counter() - started
    ended = resource.getrusage(resource.RUSAGE_CHILDREN)  # the plan's process and every child it forked and reaped
    cpu = ended.ru_utime + ended.ru_stime - children.ru_utime - children.ru_stime
    shutil.rmtree(cache, ignore_errors=True)
    answer = (json.loads(done.stdout[done.stdout.index("{"):].replace(cache, "$HF_MEMFIT_CACHE"))
              if done.returncode == 0 else {"error": done.stderr.strip().splitlines()[-1:]})
    traces = sum("tracing" in line for line in done.stderr.splitlines())
    return {"wall_s": round(wall, 1), "cpu_s": round(cpu, 1), "traces": traces, "rc": done.returncode, "answer": answer}


def differences(before: dict, after: dict) -> list[str]:
    """Where two answers differ: top-level keys, and for the runners-up which ones."""
    out = []
    for key in sorted(set(before) | set(after)):
        if before.get(key) == after.get(key):
            continue
        if key == "alternatives":
            # a field one tree's answers have and the other's lack is not a difference of the answer
            out += [f"alternatives[{i}]" for i, (b, a) in enumerate(zip(before[key], after[key]))
                    if any(b[k] != a[k] for k in set(b) & set(a))]
            if len(before[key]) != len(after[key]):
                out.append("alternatives: count")
        elif key == "estimate":
            out += [f"estimate.{k}" for k in sorted(set(before[key]) | set(after[key]))
                    if before[key].get(k) != after[key].get(k) and k != "notes"]
        else:
            out.append(key)
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("rows", nargs="+", choices=sorted(ROWS))
    parser.add_argument("--before", type=Path, required=True, help="a checkout of the tree to compare with")
    parser.add_argument("--repeat", type=int, default=1)
    options = parser.parse_args()
    rows = json.loads(RESULTS.read_text()) if RESULTS.exists() else {}
    for name in options.rows:
        runs = {"before": [], "after": []}
        for _ in range(options.repeat):
            for label, tree in (("before", options.before), ("after", HERE)):
                runs[label].append(run(ROWS[name], tree))
        before, after = runs["before"][-1], runs["after"][-1]
        rows[name] = {"command": "hf-memfit plan " + " ".join(ROWS[name]),
                      **{label: {"wall_s": [r["wall_s"] for r in done], "cpu_s": [r["cpu_s"] for r in done],
                                 "traces": done[-1]["traces"], "rc": done[-1]["rc"]} for label, done in runs.items()},
                      "answers_differ_in": differences(before["answer"], after["answer"])}
        print(f"{name:24s} before {rows[name]['before']['wall_s']} s (CPU {rows[name]['before']['cpu_s']} s) "
              f"{before['traces']:3d} traces | after {rows[name]['after']['wall_s']} s (CPU "
              f"{rows[name]['after']['cpu_s']} s) {after['traces']:3d} traces | differ: "
              f"{rows[name]['answers_differ_in'] or 'nothing'}", flush=True)
        RESULTS.write_text(json.dumps(rows, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
