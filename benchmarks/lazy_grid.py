"""Cold first plans with the lazy grid search against the exhaustive one: the same plan, fewer traced fits.

`planner/lazy_grid.py` estimates a candidate only when its step time (known before its memory) could still
make it the plan, a runner-up or a faster misfit. Each row runs `hf-memfit plan ... --json` twice in fresh
processes, each with an empty cache (`HF_MEMFIT_CACHE`): once as shipped (lazy) and once with
`lazy_grid.LAZY = False` (every candidate estimated, as before). It records the wall time, the traces each
made (counted from the progress lines) and whether the two JSON answers (plan, estimate, runners-up with
their reasons) are identical.

    PYTHONPATH=$PWD python benchmarks/lazy_grid.py                      # every row -> results/lazy_grid.json
    PYTHONPATH=$PWD python benchmarks/lazy_grid.py vit whisper          # some rows, replacing theirs

Run one at a time on an otherwise idle machine: the two runs of a row are timed back to back.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

# The cold plans of docs/benchmarks.md section 15 (issue 18's catalogue), then text families without formulas.
ROWS = {
    "vit": ["google/vit-base-patch16-224", "--gpu", "a100", "--global-batch-size", "32"],
    "wav2vec2": ["facebook/wav2vec2-base-960h", "--gpu", "a100", "--global-batch-size", "32", "--audio-seconds", "10"],
    "whisper": ["openai/whisper-small", "--gpu", "a100", "--global-batch-size", "32"],
    "smolvlm": ["HuggingFaceTB/SmolVLM-Instruct", "--gpu", "a100", "--global-batch-size", "32", "--task",
                "image-text-to-text", "--seq-len", "512"],
    "llava-1.5": ["llava-hf/llava-1.5-7b-hf", "--gpu", "a100", "--global-batch-size", "32", "--task",
                  "image-text-to-text", "--seq-len", "512"],
    "llava-1.5-a10g-lora": ["llava-hf/llava-1.5-7b-hf", "--gpu", "a10g", "--global-batch-size", "16", "--task",
                            "image-text-to-text", "--seq-len", "512", "--lora-r", "16", "--lora-target-regex",
                            r".*language_model.*\.(q_proj|k_proj|v_proj|o_proj)"],
    "gemma-3": ["google/gemma-3-4b-it", "--gpu", "a100", "--global-batch-size", "32", "--task", "image-text-to-text",
                "--seq-len", "512"],
    "qwen3-8b-qlora": ["Qwen/Qwen3-8B-Base", "--gpu", "a10g", "--global-batch-size", "32", "--seq-len", "2048",
                       "--load-in-4bit", "--lora-r", "16"],
}
RESULTS = Path(__file__).parent / "results" / "lazy_grid.json"


def run(args: list[str], lazy: bool) -> dict:
    cache = tempfile.mkdtemp(prefix="memfit_lazy_bench_")
    code = ("import sys; import hf_memfit.planner.lazy_grid as g; g.LAZY = " + str(lazy) +
            "; from hf_memfit.cli.main import run; run()")  # as the `hf-memfit` command runs (no teardown)
    started = time.perf_counter()
    done = subprocess.run([sys.executable, "-c", code, "plan", *args, "--json"], capture_output=True, text=True,
                          env={**os.environ, "HF_MEMFIT_CACHE": cache})
    wall = time.perf_counter() - started
    shutil.rmtree(cache, ignore_errors=True)
    lines = done.stderr.splitlines()
    # The notes name the cache folder, which differs between the two runs. Libraries may print to stdout when
    # imported (torchao's kernel loader): the JSON object starts at the first "{".
    answer = (json.loads(done.stdout[done.stdout.index("{"):].replace(cache, "$HF_MEMFIT_CACHE"))
              if done.returncode == 0 else {"error": done.stderr.strip().splitlines()[-1:]})
    return {"wall_s": round(wall, 1), "traces": sum("tracing" in line for line in lines),
            "exact_confirmations": sum("confirming in exact mode" in line for line in lines),
            "rc": done.returncode, "answer": answer}


def main(names: list[str]) -> int:
    rows = json.loads(RESULTS.read_text()) if RESULTS.exists() else {}
    for name in names or list(ROWS):
        load = os.getloadavg()[0]
        lazy, exhaustive = run(ROWS[name], True), run(ROWS[name], False)
        same = lazy["answer"] == exhaustive["answer"]
        rows[name] = {"command": "hf-memfit plan " + " ".join(ROWS[name]), "load_before": round(load, 2),
                      "lazy": {k: lazy[k] for k in ("wall_s", "traces", "rc")},
                      "exhaustive": {k: exhaustive[k] for k in ("wall_s", "traces", "rc")}, "identical": same}
        print(f"{name:22s} lazy {lazy['wall_s']:6.1f} s {lazy['traces']:3d} traces | exhaustive "
              f"{exhaustive['wall_s']:6.1f} s {exhaustive['traces']:3d} traces | identical answer: {same} "
              f"(load {load:.1f})", flush=True)
        RESULTS.write_text(json.dumps(rows, indent=1) + "\n")
    return 0 if all(r["identical"] for r in rows.values()) else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
