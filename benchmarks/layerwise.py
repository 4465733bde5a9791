"""GaLore / APOLLO through the real HF `Trainer`, layerwise and not: predicted vs the CPU allocator's peak.

Each row builds a 4-layer Llama-3.2-1B-shaped model (hidden 256, GQA 8:2, 32k vocabulary, tied embeddings:
the `lever` rows of accuracy.py) and trains it for two optimizer steps with `transformers.Trainer(optim=...)`
on the CPU (`use_cpu=True`), in a forked child, under the PyTorch profiler with `profile_memory=True`: the
maximum of the running sum of the allocator's `[memory]` events, from model creation to the end of
training, is the measured peak. The Trainer builds the optimizer itself: for `*_layerwise` one optimizer per
parameter and the `register_post_accumulate_grad_hook`s that step each parameter inside backward and free
its gradient. Both estimator modes predict the same step (`--device cpu`).

galore_torch's 8-bit step calls `torch.cuda.synchronize()`, which a CPU-only torch refuses; it is made a
no-op here (`step.cuda_synchronize_without_cuda`), as the estimator's trace does.

    PYTHONPATH=$PWD python benchmarks/layerwise.py             # all rows, writes benchmarks/results/layerwise.json
    PYTHONPATH=$PWD python benchmarks/layerwise.py apollo      # rows whose optimizer contains "apollo"
"""

from __future__ import annotations

import json
import statistics
import sys
import tempfile
from pathlib import Path

import torch  # noqa: F401 - imported in the parent so that forked children start warm
import transformers  # noqa: F401

sys.path.insert(0, str(Path(__file__).parent))
from common import run_forked  # noqa: E402

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
MODEL = dict(model_type="llama", num_hidden_layers=4, hidden_size=256, intermediate_size=688,
             num_attention_heads=8, num_key_value_heads=2, head_dim=32, vocab_size=32000,
             tie_word_embeddings=True, max_position_embeddings=2048)
BATCH, SEQ = 1, 32  # small enough that the optimizer's work, not the activations, decides the peak
OPTIMS = ["galore_adamw", "galore_adamw_layerwise", "galore_adamw_8bit", "galore_adamw_8bit_layerwise",
          "apollo_adamw", "apollo_adamw_layerwise"]


class Rows(torch.utils.data.Dataset):
    def __len__(self):
        return 64

    def __getitem__(self, i):
        ids = torch.randint(0, MODEL["vocab_size"], (SEQ,), generator=torch.Generator().manual_seed(i))
        return {"input_ids": ids, "labels": ids.clone()}


def run_row(optim: str, emit) -> None:
    from hf_memfit.estimator.measure import allocator_peak, profiled_allocations
    from transformers import AutoConfig, AutoModelForCausalLM, Trainer, TrainingArguments

    from hf_memfit.estimator.assemble import estimate_settings
    from hf_memfit.settings import TrainSettings
    from hf_memfit.models.spec import ModelSpec
    from hf_memfit.estimator.step import cuda_synchronize_without_cuda

    with tempfile.TemporaryDirectory() as out, cuda_synchronize_without_cuda():
        args = TrainingArguments(output_dir=out, optim=optim, optim_target_modules=TARGETS,
                                 per_device_train_batch_size=BATCH, max_steps=2, use_cpu=True, report_to=[],
                                 save_strategy="no", disable_tqdm=True, dataloader_num_workers=0)
        torch.manual_seed(0)
        with profiled_allocations() as prof:
            model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**MODEL), dtype=torch.float32)
            trainer = Trainer(model=model, args=args, train_dataset=Rows())
            trainer.train()
            del trainer, model
    measured = allocator_peak(prof)
    spec = ModelSpec.from_config("llama-L4", MODEL)
    settings = TrainSettings(batch_size=BATCH, seq_len=SEQ, device="cpu", optim=optim,
                             optim_target_modules=tuple(TARGETS)).validate(spec)
    result = {"optim": optim, "measured": measured}
    for mode in ("fast", "exact"):
        est = estimate_settings(spec, settings.replace(mode=mode))
        result[mode] = est.peak_allocated_bytes
        result[f"{mode}_region"] = est.peak_region
    emit(result)


def main(filters: list[str]) -> int:
    rows = []
    for optim in [o for o in OPTIMS if not filters or any(f in o for f in filters)]:
        result, crash = run_forked(lambda emit, optim=optim: run_row(optim, emit), timeout_s=900)
        if crash or "row_error" in result:
            print(f"{optim}: FAILED {crash or result['row_error']}\n{result.get('traceback', '')}", flush=True)
            rows.append({"optim": optim, "error": crash or result["row_error"]})
            continue
        for mode in ("fast", "exact"):
            result[f"error_{mode}"] = result[mode] / result["measured"] - 1
        rows.append(result)
        print(f"{optim:30} measured {result['measured'] / 2**20:8.2f} MiB  exact {result['error_exact']:+7.3%}"
              f" ({result['exact_region']})  fast {result['error_fast']:+7.3%} ({result['fast_region']})", flush=True)
    done = [r for r in rows if "error" not in r]
    for mode in ("exact", "fast"):
        errors = [abs(r[f"error_{mode}"]) for r in done]
        if errors:
            print(f"{mode}: median |error| {statistics.median(errors):.3%}, max {max(errors):.3%} over {len(errors)} rows")
    if not filters:
        out = Path(__file__).parent / "results" / "layerwise.json"
        out.write_text(json.dumps(rows, indent=1) + "\n")
        print(f"wrote {out}")
    return 1 if len(done) < len(rows) else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
