#!/usr/bin/env bash
# Everything a GPU session measures, in one prepared run (docs/benchmarks.md section 19 records the results):
#   1. the suite's GPU-marked tests (CUDA constants, attention kernels, 4-bit QLoRA, the trainer's snapshot);
#   2. the long-context QLoRA sweep (benchmarks/gpu_qlora_sweep.py measure), one real 4-bit Llama-3.1-8B;
#   3. single `check --json` rows: the attention kernels (SDPA, eager) of the suite's tiny Llama at 4K and 16K
#      tokens, GPT-2 with dropout, and Qwen2.5-0.5B at micro-batch 2 with the allocator's memory snapshot;
#   4. `hf-memfit check --grid` on Qwen2.5-0.5B (fast predictions; benchmarks/gpu_results.py predicts both modes).
# Each step has its own time limit and writes its results under $OUT as it goes, so a slow step costs only itself.
# It leaves 5 files under $OUT (the device tool brings back at most 8). Building the 8B model from random weights
# took 276 s of one H200 session (where, not profiled: writing and loading the checkpoint took 9 s of it):
# give step 2 a call of its own when device time is short.
#
#   OUT=gpu-results bash benchmarks/gpu_session.sh [SEQ_LENGTHS]
set -u
OUT=${OUT:-gpu-results}
SEQS=${1:-1024,8192,28454,49152}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
export HF_MEMFIT_CACHE=${HF_MEMFIT_CACHE:-$(mktemp -d)}
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
PY=${PYTHON:-python3}

{
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
    "$PY" -c "import torch, transformers, peft, accelerate, bitsandbytes as b; print('torch', torch.__version__, 'cuda', torch.version.cuda, '| transformers', transformers.__version__, '| peft', peft.__version__, '| accelerate', accelerate.__version__, '| bitsandbytes', b.__version__)"
} 2>&1 | tee "$OUT/session.log"

echo "== 1. GPU-marked tests" | tee -a "$OUT/session.log"
timeout 240 "$PY" -m pytest -m gpu tests/test_check.py tests/test_trainer.py -q -p no:cacheprovider -rA \
    2>&1 | tee -a "$OUT/session.log" | tail -40

echo "== 2. long-context QLoRA sweep: $SEQS" | tee -a "$OUT/session.log"
timeout 330 "$PY" benchmarks/gpu_qlora_sweep.py measure --seq "$SEQS" --json "$OUT/qlora_sweep.json" \
    2>&1 | tee -a "$OUT/session.log"

echo "== 3. attention kernels: the suite's tiny Llama at 4K and 16K tokens" | tee -a "$OUT/session.log"
"$PY" -c "import json, sys; sys.path.insert(0, 'tests'); from conftest import TINY_LLAMA; json.dump(TINY_LLAMA, open('/tmp/tiny_llama.json', 'w'))"
for seq in 4096 16384; do
    for attn in sdpa eager; do
        timeout 90 "$PY" -m hf_memfit.cli check /tmp/tiny_llama.json --batch-size 1 --seq-len $seq \
            --precision bf16-mixed --attn-implementation $attn --device cuda --json > "$OUT/attn_${attn}_$seq.json"
    done
done

# Dropout on CUDA: the fused kernel keeps a bool mask where exact mode's CPU emulation keeps the input's dtype
# (docs/benchmarks.md section 19, open): GPT-2 has dropout 0.1 on its embeddings, attention and residuals.
timeout 90 "$PY" -m hf_memfit.cli check gpt2 --batch-size 4 --seq-len 512 --precision bf16-mixed \
    --attn-implementation eager --device cuda --json > "$OUT/dropout_gpt2_eager.json"
# The open Qwen2.5-0.5B under-count (section 19): the allocator's history names every block alive at the peak.
timeout 120 "$PY" -m hf_memfit.cli check Qwen/Qwen2.5-0.5B --batch-size 2 --seq-len 512 --precision bf16-mixed \
    --mode fast --device cuda --json --memory-snapshot "$OUT/qwen_b2_snapshot.pickle" > "$OUT/qwen_b2.json"
gzip -f "$OUT/qwen_b2_snapshot.pickle"  # the device tool brings back files up to 16 MiB; gunzip it for memory_viz
# One file for the single rows: the device tool brings back at most 8 files.
"$PY" -c "import glob, json, os, sys; paths = sorted(glob.glob('$OUT/attn_*.json') + glob.glob('$OUT/dropout_*.json') + ['$OUT/qwen_b2.json']); rows = [json.load(open(p)) | {'file': os.path.basename(p)} for p in paths if os.path.getsize(p)]; json.dump(rows, open('$OUT/single_rows.json', 'w'), indent=2); [os.remove(p) for p in paths]"

echo "== 4. hf-memfit check --grid" | tee -a "$OUT/session.log"
timeout 240 "$PY" -m hf_memfit.cli check Qwen/Qwen2.5-0.5B --batch-size 2 --seq-len 512 --precision bf16-mixed \
    --mode fast --grid --out "$OUT/check_grid.json" 2>&1 | tee -a "$OUT/session.log"
echo "== done" | tee -a "$OUT/session.log"
