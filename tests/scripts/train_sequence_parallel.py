"""Two ranks of Ulysses SP (sp_size=2) through MemFitTrainer on the CPU; run by tests/test_sequence_parallel.py.

    DS_ACCELERATOR=cpu python -m torch.distributed.run --nproc_per_node 2 train_sequence_parallel.py OUT_DIR

Each rank writes OUT_DIR/rank<R>.json: the plan's sequence split and batch, and the trainer's logged prediction
and measurement (`memfit/*`).
"""

import json
import os
import sys

import torch
from accelerate.parallelism_config import ParallelismConfig
from accelerate.utils import DeepSpeedSequenceParallelConfig
from transformers import AutoConfig, AutoModelForCausalLM, TrainerCallback

from hf_memfit.integrations.trainer import MemFitArguments, MemFitTrainer

SEQ = 512
out = sys.argv[1]


class Rows(torch.utils.data.Dataset):
    def __len__(self):
        return 16

    def __getitem__(self, i):
        ids = torch.randint(0, 1024, (SEQ,), generator=torch.Generator().manual_seed(i))
        return {"input_ids": ids, "labels": ids.clone(), "position_ids": torch.arange(SEQ)}


class Logs(TrainerCallback):
    def __init__(self):
        self.records = {}

    def on_log(self, args, state, control, logs=None, **kwargs):
        self.records.update(logs or {})


torch.manual_seed(0)
config = AutoConfig.for_model("llama", num_hidden_layers=2, hidden_size=128, intermediate_size=256,
                              num_attention_heads=4, num_key_value_heads=2, vocab_size=1024,
                              max_position_embeddings=SEQ, tie_word_embeddings=False)
model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")
args = MemFitArguments(
    # a global batch of 2; on the CPU the plan runs it as 2 micro-batches of 1 under SP (planner/search.py)
    output_dir=os.path.join(out, "run"), per_device_train_batch_size=2, max_steps=2, report_to=[],
    ddp_backend="gloo", logging_steps=1, save_strategy="no", optim="adamw_torch", memory_budget="4GiB",
    keep_optimizer=True, dataloader_num_workers=0,
    deepspeed={"zero_optimization": {"stage": 1, "reduce_bucket_size": 128 * 128, "allgather_bucket_size": 128 * 128},
               "train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
               "train_batch_size": "auto", "gradient_clipping": "auto", "bf16": {"enabled": "auto"},
               "sequence_parallel_size": 2},
    parallelism_config=ParallelismConfig(sp_size=2, sp_backend="deepspeed",
                                         sp_handler=DeepSpeedSequenceParallelConfig(sp_attn_implementation="sdpa")))
logs = Logs()
trainer = MemFitTrainer(model=model, args=args, train_dataset=Rows(), callbacks=[logs])
trainer.train()
s = trainer.memfit_result.estimate.settings
with open(os.path.join(out, f"rank{os.environ['RANK']}.json"), "w") as handle:
    json.dump({"sp_size": s.sp_size, "dp_size": s.dp_size, "batch_size": s.batch_size, "seq_len": s.seq_len,
               "accumulation": s.gradient_accumulation_steps, "zero_stage": s.zero_stage,
               "loss": logs.records.get("train_loss"),
               **{k: v for k, v in logs.records.items() if k.startswith("memfit/")}}, handle)
# Tear the gloo group down before the interpreter exits: left to exit, a rank's gloo threads can be destroyed
# still joinable ("terminate called without an active exception", SIGABRT), and torchrun then fails the run.
torch.distributed.barrier()
torch.distributed.destroy_process_group()
