"""A few HF Trainer steps of a tiny GPT-2 under a DeepSpeed config, on the CPU, in one process.

    RANK=0 WORLD_SIZE=1 LOCAL_RANK=0 MASTER_ADDR=127.0.0.1 MASTER_PORT=29511 \
        python tests/scripts/train_deepspeed.py --config ds_configs/zero2.json --output-dir /tmp/ds

(or `deepspeed --num_gpus 1 tests/scripts/train_deepspeed.py --config ...`). Prints one JSON
line starting with RESULT: the logged losses and how many parameter tensors changed.
"""

import argparse
import contextlib
import json
import math
import os

import torch
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

VOCAB, SEQ = 128, 16


class RandomTokens(torch.utils.data.Dataset):
    def __init__(self, n: int = 32):
        g = torch.Generator().manual_seed(0)
        self.ids = torch.randint(0, VOCAB, (n, SEQ), generator=g)

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def _snapshot(model) -> list[torch.Tensor]:
    """Full fp32 copies of the parameters; ZeRO-3 partitions them, so gather first."""
    params = list(model.parameters())
    gather = contextlib.nullcontext()
    if any(hasattr(p, "ds_id") for p in params):
        import deepspeed

        gather = deepspeed.zero.GatheredParameters(params)
    with gather:
        return [p.detach().float().clone() for p in params]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--config", required=True)
    parser.add_argument("--output-dir", required=True)
    parser.add_argument("--max-steps", type=int, default=3)
    parser.add_argument("--local_rank", type=int, default=0)  # passed by the `deepspeed` launcher
    parser.add_argument("--bf16", action="store_true", help="fills the configs' bf16.enabled \"auto\"")
    parser.add_argument("--memfit", action="store_true", help="train with MemFitTrainer (budget 1GiB) instead")
    args = parser.parse_args()

    torch.manual_seed(0)
    width = int(os.environ.get("TINY_WIDTH", 64))  # the memory check needs a model larger than DeepSpeed's fixed buffers
    config = GPT2Config(n_layer=2, n_embd=width, n_head=2, vocab_size=VOCAB, n_positions=SEQ, bos_token_id=0, eos_token_id=0)
    arguments_class = TrainingArguments
    extra = {}
    if args.memfit:
        from hf_memfit import MemFitArguments

        arguments_class, extra = MemFitArguments, {"memory_budget": "1GiB"}
    training_args = arguments_class(
        **extra,
        output_dir=args.output_dir,
        max_steps=args.max_steps,
        per_device_train_batch_size=2,
        gradient_accumulation_steps=2,
        learning_rate=1e-2,  # large, so every parameter visibly moves in 3 steps
        logging_steps=1,
        deepspeed=args.config,
        report_to=[],
        save_strategy="no",
        use_cpu=True,
        bf16=args.bf16,
    )
    # After the args: with a ZeRO-3 config they make `_from_config` (and `from_pretrained`)
    # build under deepspeed.zero.Init, so parameters are partitioned from the start.
    model = GPT2LMHeadModel._from_config(config)
    partitioned_at_init = any(hasattr(p, "ds_id") for p in model.parameters())
    if args.memfit:
        from hf_memfit import MemFitTrainer

        trainer = MemFitTrainer(model=model, args=training_args, train_dataset=RandomTokens())
    else:
        trainer = Trainer(model=model, args=training_args, train_dataset=RandomTokens())

    before = _snapshot(model)
    trainer.train()
    after = _snapshot(model)
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    moved = sum(1 for b, a in zip(before, after) if not torch.equal(b, a))
    engine = trainer.model_wrapped
    result = {
        "losses": losses,
        "finite": all(math.isfinite(x) for x in losses),
        "params": len(before),
        "params_changed": moved,
        "zero_stage": engine.zero_optimization_stage(),
        "optimizer": type(engine.optimizer).__name__,
        "basic_optimizer": type(getattr(engine, "basic_optimizer", None)).__name__,
        "partitioned_at_init": partitioned_at_init,
        "bf16": engine.bfloat16_enabled(),
        "offload_optimizer": str(engine.zero_offload_optimizer().device) if engine.zero_offload_optimizer() else None,
        "offload_param": str(engine.zero_offload_param().device) if engine.zero_offload_param() else None,
        "world_size": training_args.world_size,
        "micro_batch": engine.train_micro_batch_size_per_gpu(),
        "accumulation": engine.gradient_accumulation_steps(),
    }
    if args.memfit:
        plan = trainer.memfit_plan
        result["plan"] = {"micro_batch": plan.per_device_train_batch_size,
                          "accumulation": plan.gradient_accumulation_steps, "zero_stage": plan.settings.zero_stage,
                          "offload_optimizer": plan.settings.offload_optimizer,
                          "offload_param": plan.settings.offload_param}
        result["check"] = next((h for h in trainer.state.log_history if "memfit/relative_error" in h), None)
    print("RESULT " + json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
