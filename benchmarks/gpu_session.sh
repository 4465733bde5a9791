#!/usr/bin/env bash
# Everything a GPU session measures, in one prepared run (docs/benchmarks.md section 19 records the results):
#   1. the suite's GPU-marked tests (CUDA constants, attention kernels, 4-bit QLoRA, the trainer's snapshot);
#   2. the long-context QLoRA sweep (benchmarks/gpu_qlora_sweep.py measure), one real 4-bit Llama-3.1-8B;
#   3. single `check --json` rows: the attention kernels (SDPA, eager) of the suite's tiny Llama at 4K and 16K
#      tokens, GPT-2 with dropout, and Qwen2.5-0.5B at micro-batch 2 with the allocator's memory snapshot;
#   4. `hf-memfit check --grid` on Qwen2.5-0.5B (fast predictions; benchmarks/gpu_results.py predicts both modes).
#   5. `probe`: which SDPA kernel PyTorch runs for a bf16 GQA attention (flash, cuDNN, memory-efficient);
#   6. `rows`: the `check --json` rows of benchmarks/data/gpu_rows.txt, LANES processes at a time (the open rows of
#      section 19 with the allocator's snapshot, dropout models, LLM.int8(), expandable segments, vision / audio /
#      Whisper), into rows.json, the snapshots gzipped beside it.
#   7. `drift`: benchmarks/gpu_shape_drift.py over the runs of $DRIFT (max_memory_reserved over a run of varying
#      shapes against a step at the largest), into drift.json.
# Each step has its own time limit and writes its results under $OUT as it goes, so a slow step costs only itself.
# The device tool brings back at most 8 files. Building the 8B model from random weights took 276 s of one H200
# session (where, not profiled: writing and loading the checkpoint took 9 s of it): give step 2 a call of its own
# when device time is short. PARTS picks the steps (default: the first four, as the first session ran them).
#
#   OUT=gpu-results [PARTS="probe tests rows"] [LANES=3] bash benchmarks/gpu_session.sh [SEQ_LENGTHS]
set -u
OUT=${OUT:-gpu-results}
SEQS=${1:-1024,8192,28454,49152}
PARTS=" ${PARTS:-tests sweep attn grid} "
LANES=${LANES:-3}
DEVICE=${DEVICE:-cuda}  # cpu: try the steps here (rows with a snapshot are refused there)
ROWS=${ROWS:-benchmarks/data/gpu_rows.txt}
DRIFT=${DRIFT:-benchmarks/data/gpu_drift.txt}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
export HF_MEMFIT_CACHE=${HF_MEMFIT_CACHE:-$(mktemp -d)}
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
PY=${PYTHON:-python3}

{
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
    "$PY" -c "import torch, transformers, peft, accelerate, bitsandbytes as b; print('torch', torch.__version__, 'cuda', torch.version.cuda, '| transformers', transformers.__version__, '| peft', peft.__version__, '| accelerate', accelerate.__version__, '| bitsandbytes', b.__version__)"
} 2>&1 | tee "$OUT/session.log"

part() { [[ "$PARTS" == *" $1 "* ]]; }

if part probe; then
echo "== probe: the SDPA kernel for bf16 attention with grouped KV heads" | tee -a "$OUT/session.log"
timeout 60 "$PY" - <<'PROBE' 2>&1 | tee -a "$OUT/session.log"
import torch
from torch.profiler import ProfilerActivity, profile

def kernels(gqa):
    q = torch.randn(1, 14, 4096, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    kv_heads = 2 if gqa else 14
    k = torch.randn(1, kv_heads, 4096, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    v = torch.randn_like(k, requires_grad=True)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)
        out.sum().backward()
        torch.cuda.synchronize()
    names = sorted({e.name for e in prof.events() if any(w in e.name.lower() for w in ("flash", "cudnn", "fmha", "efficient", "attention"))})
    print("gqa" if gqa else "mha", "->", names[:8])

for gqa in (True, False):
    kernels(gqa)
print("cudnn", torch.backends.cudnn.version(), "| flash", torch.backends.cuda.flash_sdp_enabled(), "| cudnn sdp", torch.backends.cuda.cudnn_sdp_enabled())
PROBE
fi

if part tests; then
echo "== 1. GPU-marked tests" | tee -a "$OUT/session.log"
timeout 240 "$PY" -m pytest -m gpu tests/test_check.py tests/test_trainer.py -q -p no:cacheprovider -rA \
    2>&1 | tee -a "$OUT/session.log" | tail -40
fi

if part sweep; then
echo "== 2. long-context QLoRA sweep: $SEQS" | tee -a "$OUT/session.log"
timeout 330 "$PY" benchmarks/gpu_qlora_sweep.py measure --seq "$SEQS" --json "$OUT/qlora_sweep.json" \
    2>&1 | tee -a "$OUT/session.log"
fi

"$PY" -c "import json, sys; sys.path.insert(0, 'tests'); from conftest import TINY_LLAMA; json.dump(TINY_LLAMA, open('/tmp/tiny_llama.json', 'w'))"
# Qwen2-VL-7B is not in the catalogue: its published config, as benchmarks/published_media.py holds it
"$PY" -c "import json, sys; sys.path.insert(0, 'benchmarks'); from published_media import INLINE_CONFIGS; json.dump(INLINE_CONFIGS['Qwen/Qwen2-VL-7B-Instruct'], open('/tmp/qwen2vl_7b.json', 'w'))"

if part attn; then
echo "== 3. attention kernels: the suite's tiny Llama at 4K and 16K tokens" | tee -a "$OUT/session.log"
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

fi

if part grid; then
echo "== 4. hf-memfit check --grid" | tee -a "$OUT/session.log"
timeout 240 "$PY" -m hf_memfit.cli check Qwen/Qwen2.5-0.5B --batch-size 2 --seq-len 512 --precision bf16-mixed \
    --mode fast --grid --out "$OUT/check_grid.json" 2>&1 | tee -a "$OUT/session.log"
fi

if part rows; then
echo "== rows: $ROWS, $LANES at a time" | tee -a "$OUT/session.log"
mkdir -p "$OUT/rows"
grep -v '^#' "$ROWS" | grep . | while read -r name args; do
    args=${args//TINY_LLAMA//tmp/tiny_llama.json}
    args=${args//QWEN2VL_7B//tmp/qwen2vl_7b.json}
    args=${args//@SNAP/--memory-snapshot $OUT/$name.pickle}
    echo "timeout 200 $PY -m hf_memfit.cli check $args --device $DEVICE --json > $OUT/rows/$name.json 2> $OUT/rows/$name.err"
done > "$OUT/.rows.cmds"
xargs -P "$LANES" -d '\n' -I{} bash -c '{}; echo "row done (rc=$?): {}" | cut -c1-160' < "$OUT/.rows.cmds" 2>&1 | tee -a "$OUT/session.log"
"$PY" - "$OUT" <<'MERGE' 2>&1 | tee -a "$OUT/session.log"
import glob, json, os, sys
out = sys.argv[1]
rows = []
for path in sorted(glob.glob(f"{out}/rows/*.json")):
    name = os.path.basename(path)[:-5]
    err = open(path[:-5] + ".err").read()
    try:
        rows.append(json.load(open(path)) | {"name": name})
    except ValueError:
        rows.append({"name": name, "failed": err[-3000:]})
    if rows[-1].get("failed") is None:
        e = rows[-1]["error_percent"]
        print(name, {m: round(v["peak_allocated"], 1) for m, v in e.items()}, "measured", rows[-1]["measured"]["peak_allocated_bytes"])
    else:
        print(name, "FAILED", err.strip().splitlines()[-1:] if err.strip() else "")
json.dump(rows, open(f"{out}/rows.json", "w"), indent=1)
MERGE
rm -rf "$OUT/rows" "$OUT/.rows.cmds"
gzip -f "$OUT"/*.pickle 2>/dev/null
ls -la "$OUT" | tee -a "$OUT/session.log"
fi
if part drift; then
echo "== drift: $DRIFT, $LANES at a time" | tee -a "$OUT/session.log"
mkdir -p "$OUT/drift"
grep -v '^#' "$DRIFT" | grep . | while read -r name args; do
    args=${args//QWEN2VL_7B//tmp/qwen2vl_7b.json}
    echo "timeout 300 $PY benchmarks/gpu_shape_drift.py $args --out $OUT/drift/$name.json > $OUT/drift/$name.log 2>&1"
done > "$OUT/.drift.cmds"
xargs -P "$LANES" -d '\n' -I{} bash -c '{}; echo "drift done (rc=$?): {}" | cut -c1-160' < "$OUT/.drift.cmds" 2>&1 | tee -a "$OUT/session.log"
grep -h -v "Warning\|warn(\|torchao\|_pytree" "$OUT"/drift/*.log | tail -40 | tee -a "$OUT/session.log"
"$PY" -c "import glob, json, os; json.dump({os.path.basename(p)[:-5]: json.load(open(p)) for p in sorted(glob.glob('$OUT/drift/*.json'))}, open('$OUT/drift.json', 'w'))"
rm -rf "$OUT/drift" "$OUT/.drift.cmds"
fi
echo "== done" | tee -a "$OUT/session.log"
