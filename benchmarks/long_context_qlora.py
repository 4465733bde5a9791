"""Long-context QLoRA on one GPU: the longest sequence hf-memfit says fits, per card and mode.

Llama-3.1-8B (and Llama-3.3-70B, the same shapes as Llama-3.1-70B), 4-bit NF4 with double
quantisation, LoRA r=32 on all linear layers, flash-attention 2, gradient checkpointing,
batch 1, bf16 compute: the setting of Unsloth's context-length tables, whose "Hugging Face +
FA2" column is the plain HF stack (unsloth.ai/blog/llama3-3, Dec 2024). A length fits a card
when hf-memfit's device total (what nvidia-smi shows: reserved memory, cuBLAS workspaces and
the CUDA context) is at most the card's memory, taken as N GiB for an "N GB" card.

Fast mode is bisected directly. Exact mode traces the real step (about 30 s a length), so it is
solved with fast mode as the interpolant: exact - fast is measured at the fast answer, fast mode
is bisected against the capacity less that difference, and the result is checked in exact mode
(twice at most).

    python benchmarks/long_context_qlora.py [--json PATH] [--fast-only] [--breakdown-seq 8192]

Each card is solved twice: as peft's QLoRA recipe runs it (`prepare_model_for_kbit_training`, hf-memfit's
default for the plain Trainer with `--load-in-4bit`: every parameter that is not 4-bit upcast to fp32, so the
residual stream is fp32), and without it (TRL 1.16's trainers, or TRL's older `peft_module_casting_to_bf16`,
which cast the embedding and head back to bf16). It also prints each term of the device total at one length.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import sys
import time
import warnings
from contextlib import redirect_stderr, redirect_stdout

os.environ.setdefault("HF_HUB_OFFLINE", "1")
warnings.filterwarnings("ignore")
GiB = 2**30

CARDS_GB = (12, 16, 24, 40, 48, 80)
# Unsloth, "Llama 3.3 + ... 89K context" (unsloth.ai/blog/llama3-3, Dec 2024): "Hugging Face+FA2" column of the
# max-context tables, QLoRA r=32 on q,k,v,o,gate,up,down, batch 1, sequences padded to the length, A100 80GB.
# Every cell was read in stored copies of the page and of docs.unsloth.ai/basics/unsloth-benchmarks ("Llama 3.1 (8B)
# max. context length"). The 8B column is exactly linear in the card's memory, 1,619 tokens per 4 GB between any
# two cells (`LINEAR_TOKENS_PER_4GB`): below 80 GB the cells follow one line through the 80 GB run, not runs on
# those cards.
PUBLISHED = {
    "meta-llama/Llama-3.1-8B": {8: None, 12: 932, 16: 2_551, 24: 5_789, 40: 12_264, 48: 15_502, 80: 28_454},
    "meta-llama/Llama-3.1-70B": {48: None, 80: 6_916},
}
READ_HERE = {(model, gb) for model, cells in PUBLISHED.items() for gb in cells}
LINEAR_TOKENS_PER_4GB = 1_619
SETTINGS = dict(batch_size=1, precision="bf16-mixed", load_in_4bit=True, lora_r=32, lora_alpha=64,
                lora_target_modules=("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"),
                gradient_checkpointing=True, attn_implementation="flash_attention_2", optim="adamw_torch",
                gpu="a100")


def _quiet(fn, *args, **kwargs):
    sink = io.StringIO()
    with redirect_stdout(sink), redirect_stderr(sink):
        return fn(*args, **kwargs)


def estimate_at(model: str, seq: int, mode: str, prepared: bool = True):
    from hf_memfit.estimator.assemble import estimate

    return _quiet(estimate, model, seq_len=seq, mode=mode, prepare_model_for_kbit_training=prepared, **SETTINGS)


def longest_fast(model: str, capacity: int, prepared: bool, low: int = 16, high: int = 1 << 20) -> int | None:
    """The longest multiple of 16 whose fast device total is at most `capacity`; None if not even `low` fits."""
    total = lambda s: estimate_at(model, s, "fast", prepared).device_total_bytes  # noqa: E731
    if total(low) > capacity:
        return None
    while low + 16 <= high:
        mid = (low + high) // 32 * 16
        if mid <= low:
            break
        low, high = (mid, high) if total(mid) <= capacity else (low, mid)
    return low


def longest_exact(model: str, capacity: int, fast_answer: int | None, prepared: bool) -> tuple[int | None, int]:
    """Exact mode's longest length, found through fast mode (see the module docstring); and exact calls made."""
    if fast_answer is None:
        return None, 0
    seq, calls = fast_answer, 0
    for _ in range(2):
        exact = estimate_at(model, seq, "exact", prepared).device_total_bytes
        calls += 1
        delta = exact - estimate_at(model, seq, "fast", prepared).device_total_bytes
        new = longest_fast(model, capacity - delta, prepared)
        if new is None or new == seq:
            return new, calls
        seq = new
    return (seq if estimate_at(model, seq, "exact", prepared).device_total_bytes <= capacity else None), calls + 1


def breakdown(model: str, seq: int, mode: str, prepared: bool) -> dict:
    est = estimate_at(model, seq, mode, prepared)
    return {"seq": seq, "mode": mode, "prepared": prepared, "peak_phase": est.peak_region,
            "device_total": est.device_total_bytes, "peak_allocated": est.peak_allocated_bytes,
            "peak_reserved": est.peak_reserved_bytes, "breakdown": est.breakdown, "notes": est.notes}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", metavar="PATH")
    parser.add_argument("--fast-only", action="store_true")
    parser.add_argument("--breakdown-seq", type=int, default=8192)
    parser.add_argument("--models", default=",".join(PUBLISHED))
    args = parser.parse_args(argv)
    started = time.time()
    rows = []
    print("| model | card | published HF+FA2 | recipe | fast longest | / published | exact longest | / published "
          "| fast total at published | exact total at published |")
    print("|---|---:|---:|---|---:|---:|---:|---:|---:|---:|")
    for model in args.models.split(","):
        for gb, published in sorted(PUBLISHED[model].items()):
            capacity = gb * GiB
            for prepared in (True, False):
                fast = longest_fast(model, capacity, prepared)
                exact, calls = (None, 0) if args.fast_only else longest_exact(model, capacity, fast, prepared)
                row = {"model": model, "card_gb": gb, "published": published, "prepared": prepared,
                       "published_read_here": (model, gb) in READ_HERE, "fast_longest": fast, "exact_longest": exact,
                       "exact_calls": calls}
                if published:
                    row["fast_total_at_published"] = estimate_at(model, published, "fast", prepared).device_total_bytes
                    if not args.fast_only:
                        row["exact_total_at_published"] = estimate_at(model, published, "exact",
                                                                      prepared).device_total_bytes
                rows.append(row)
                ratio = lambda v: f"{v / published:.2f}x" if v and published else "-"  # noqa: E731
                gib = lambda k: f"{row[k] / GiB:.2f} GiB" if k in row else "-"  # noqa: E731
                recipe = "prepared (default)" if prepared else "not prepared"
                print(f"| {model.split('/')[-1]} | {gb} GB | {published or 'OOM'}{'' if (model, gb) in READ_HERE else '*'} "
                      f"| {recipe} | {fast or 'none'} | {ratio(fast)} | {exact or ('-' if args.fast_only else 'none')} | "
                      f"{ratio(exact)} | {gib('fast_total_at_published')} | {gib('exact_total_at_published')} |",
                      flush=True)
    model = "meta-llama/Llama-3.1-8B"
    cells = {gb: n for gb, n in PUBLISHED[model].items() if n}
    top = max(cells)
    line = {gb: cells[top] - (top - gb) / 4 * LINEAR_TOKENS_PER_4GB for gb in cells}
    print(f"\npublished {model.split('/')[-1]} column against one line through its {top} GB cell, "
          f"{LINEAR_TOKENS_PER_4GB} tokens per 4 GB: largest deviation "
          f"{max(abs(cells[gb] - line[gb]) for gb in cells):.0f} tokens")
    modes = ("fast",) if args.fast_only else ("fast", "exact")
    terms = {f"{mode}{'' if prepared else ' not prepared'}": breakdown(model, args.breakdown_seq, mode, prepared)
             for mode in modes for prepared in (True, False)}
    print(f"\nLlama-3.1-8B at {args.breakdown_seq} tokens, A100-80GB overheads:")
    for name, entry in terms.items():
        print(f"  {name}: peak at {entry['peak_phase']}; " + ", ".join(
            f"{k} {v / GiB:.2f} GiB" for k, v in entry["breakdown"].items()) +
            f"; allocated {entry['peak_allocated'] / GiB:.2f}, reserved {entry['peak_reserved'] / GiB:.2f}, "
            f"device total {entry['device_total'] / GiB:.2f} GiB")
        for note in entry["notes"]:
            print(f"    note: {note}")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as handle:
            json.dump({"rows": rows, "breakdown": terms, "settings": {
                k: list(v) if isinstance(v, tuple) else v for k, v in SETTINGS.items()},
                "seconds": round(time.time() - started)}, handle, indent=2, default=str)
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
