"""MemFitTrainer under DeepSpeed on the CPU (one process), with injected OOMs.

    DS_ACCELERATOR=cpu RANK=0 WORLD_SIZE=1 LOCAL_RANK=0 MASTER_ADDR=127.0.0.1 MASTER_PORT=29512 \
        python tests/scripts/train_deepspeed_oom.py --stage 2 OUT_DIR

Three runs of the same tiny GPT-2 (dropout off) under a ZeRO-`stage` config:
- clean: no fault;
- backward: micro-batches over 4 samples run out of memory in the forward (redone in place, in
  chunks of 4), and the second chunk of step 1 in its backward: the run stops with a checkpoint
  of the step's start and the next rung (chunks of 2) in it (MemFitError);
- resumed: a new trainer resumes from that checkpoint, as the error's command would, and runs
  out of memory once more in the forward of the third chunk of step 2, when two chunks are
  already reduced into DeepSpeed's partitions: redone in place from there, in chunks of 1.
Each run saves its final weights (gathered under ZeRO-3) to OUT_DIR/<run>.pt and its result to OUT_DIR/<run>.json.
"""

import argparse
import contextlib
import json

import torch
from transformers import GPT2Config, GPT2LMHeadModel

from hf_memfit import MemFitArguments, MemFitTrainer
from hf_memfit.errors import MemFitError
from hf_memfit.planner.deepspeed import TEMPLATES, deepspeed_config

SEQ, VOCAB = 16, 128


class TokenDataset(torch.utils.data.Dataset):
    def __init__(self, n=48):
        self.ids = torch.randint(0, VOCAB, (n, SEQ), generator=torch.Generator().manual_seed(1))

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def oom() -> torch.OutOfMemoryError:
    return torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB (injected)")


def weights(model) -> dict:
    params = list(model.parameters())
    gather = contextlib.nullcontext()
    if any(hasattr(p, "ds_id") for p in params):
        import deepspeed

        gather = deepspeed.zero.GatheredParameters(params)
    with gather:
        return {name: p.detach().float().clone() for name, p in model.named_parameters()}


def run(name: str, stage: int, out_dir: str, resume: str | None = None) -> dict:
    config = deepspeed_config(**TEMPLATES[f"zero{stage}"])
    args = MemFitArguments(output_dir=f"{out_dir}/{'backward' if name == 'resumed' else name}", memory_budget="2GiB",
                           per_device_train_batch_size=4, gradient_accumulation_steps=2, max_steps=3,
                           learning_rate=1e-3, report_to=[], save_strategy="no", use_cpu=True, seed=0, data_seed=0,
                           logging_steps=1, disable_tqdm=True, deepspeed=config)
    torch.manual_seed(0)
    # After the args: under ZeRO-3 `_from_config` builds inside deepspeed.zero.Init.
    model = GPT2LMHeadModel._from_config(GPT2Config(n_layer=2, n_embd=64, n_head=2, vocab_size=VOCAB, n_positions=SEQ,
                                                    bos_token_id=0, eos_token_id=0, resid_pdrop=0.0, embd_pdrop=0.0,
                                                    attn_pdrop=0.0))
    trainer = MemFitTrainer(model=model, args=args, train_dataset=TokenDataset())
    seen = {"step": -1, "calls": 0, "fired": False}

    def once(step: int, call: int) -> bool:
        """True the first time this hook runs for the `call`-th time within optimizer step `step`."""
        if trainer.state.global_step != seen["step"]:
            seen["step"], seen["calls"] = trainer.state.global_step, 0
        seen["calls"] += 1
        if not seen["fired"] and trainer.state.global_step == step and seen["calls"] == call:
            seen["fired"] = True
            return True
        return False

    if name == "backward":
        def fail_forward(module, inputs):  # any micro-batch over 4 samples: chunks of 4
            if inputs[0].shape[0] > 4:
                raise oom()

        def fail_backward(module, grad_output):  # the second chunk's backward in step 1
            if once(1, 2):
                raise oom()

        model.transformer.h[1].mlp.register_forward_pre_hook(fail_forward)
        model.transformer.h[0].register_full_backward_pre_hook(fail_backward)
    if name == "resumed":
        def fail_third_chunk(module, inputs):  # step 2 in chunks of 2: the third, with two already reduced
            if once(2, 3):
                raise oom()

        model.transformer.h[1].mlp.register_forward_pre_hook(fail_third_chunk)
    error = None
    try:
        trainer.train(resume_from_checkpoint=resume)
    except MemFitError as stopped:
        error = str(stopped)
    torch.save(weights(model), f"{out_dir}/{name}.pt")
    result = {"run": name, "stage": stage, "micro_batch": trainer.args.per_device_train_batch_size,
              "accumulation": trainer.args.gradient_accumulation_steps, "recoveries": trainer._memfit_recoveries,
              "chunk": trainer._memfit_chunk, "global_step": trainer.state.global_step, "error": error,
              "layout": trainer.memfit_layout,
              "switches": [h["memfit/change"] for h in trainer.state.log_history if "memfit/change" in h]}
    with open(f"{out_dir}/{name}.json", "w") as handle:
        json.dump(result, handle)
    return result


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--stage", type=int, choices=(2, 3), required=True)
    parser.add_argument("out_dir")
    options = parser.parse_args()
    for name in ("clean", "backward"):
        run(name, options.stage, options.out_dir)
    with open(f"{options.out_dir}/backward.json") as handle:
        stopped = json.load(handle)
    checkpoint = stopped["error"].split("--resume_from_checkpoint ")[-1].strip() if stopped["error"] else None
    run("resumed", options.stage, options.out_dir, resume=checkpoint)


if __name__ == "__main__":
    main()
