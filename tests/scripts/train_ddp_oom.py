"""MemFitTrainer under DDP on the CPU (gloo), with an OOM injected on one rank only.

    accelerate launch --multi_gpu --num_processes 2 tests/scripts/train_ddp_oom.py OUT_DIR

(`--multi_gpu` picks accelerate's torchrun launcher; `use_cpu=True` makes it a gloo
MULTI_CPU run.) Three runs of the same tiny GPT-2, dropout off:
- clean: no fault;
- forward: rank 1 runs out of memory in the forward of any micro-batch over 2 samples;
- backward: rank 1 runs out of memory in the forward of any micro-batch over 4 samples
  (so micro-batches then run in chunks of 4), and rank 0 once in the backward of a chunk
  that does not all-reduce.
Each rank saves its final weights to OUT_DIR/<run>-rank<r>.pt and its result to OUT_DIR/<run>-rank<r>.json.
"""

import json
import sys

import torch
from transformers import AutoConfig, AutoModelForCausalLM

from hf_memfit import MemFitArguments, MemFitTrainer

SEQ, VOCAB = 32, 128


class TokenDataset(torch.utils.data.Dataset):
    def __init__(self, n=64):
        self.ids = torch.randint(0, VOCAB, (n, SEQ), generator=torch.Generator().manual_seed(1))

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def tiny_gpt2():
    torch.manual_seed(0)
    config = AutoConfig.for_model("gpt2", n_layer=2, n_embd=32, n_head=2, vocab_size=VOCAB, n_positions=64,
                                  bos_token_id=0, eos_token_id=0, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    return AutoModelForCausalLM.from_config(config)


def oom() -> torch.OutOfMemoryError:
    return torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB (injected)")


def run(name: str, out_dir: str) -> dict:
    model = tiny_gpt2()
    # memory_budget: roomy, so the plan is one micro-batch of 8 per rank (global batch 16 on 2 ranks)
    args = MemFitArguments(output_dir=f"{out_dir}/{name}", memory_budget="2GiB", per_device_train_batch_size=4,
                           gradient_accumulation_steps=2, max_steps=3, learning_rate=1e-3, report_to=[],
                           save_strategy="no", use_cpu=True, seed=0, data_seed=0, logging_steps=1, disable_tqdm=True)
    trainer = MemFitTrainer(model=model, args=args, train_dataset=TokenDataset())
    rank = trainer.args.process_index
    if name == "forward" and rank == 1:
        def fail_forward(module, inputs):
            if inputs[0].shape[0] > 2:
                raise oom()

        model.transformer.h[1].register_forward_pre_hook(fail_forward)
    if name == "backward":
        if rank == 1:  # first a forward OOM, so that micro-batches run in chunks of 4
            def fail_forward_once(module, inputs):
                if inputs[0].shape[0] > 4:
                    raise oom()

            model.transformer.h[1].register_forward_pre_hook(fail_forward_once)
        if rank == 0:  # then a backward OOM in a chunk that does not all-reduce (no_sync)
            fired = {"done": False}

            def fail_backward(module, grad_output):
                if not fired["done"] and trainer._memfit_chunk and not trainer.memfit_backward_syncs:
                    fired["done"] = True
                    raise oom()

            model.transformer.h[0].register_full_backward_pre_hook(fail_backward)
    trainer.train()
    torch.save({k: v.detach().clone() for k, v in model.state_dict().items()}, f"{out_dir}/{name}-rank{rank}.pt")
    result = {"run": name, "rank": rank, "world_size": trainer.args.world_size,
            "micro_batch": trainer.args.per_device_train_batch_size,
            "accumulation": trainer.args.gradient_accumulation_steps, "recoveries": trainer._memfit_recoveries,
            "chunk": trainer._memfit_chunk, "global_step": trainer.state.global_step,
            "switches": [h["memfit/change"] for h in trainer.state.log_history if "memfit/change" in h]}
    # One file per rank: the ranks share stdout, where their lines can interleave.
    with open(f"{out_dir}/{name}-rank{rank}.json", "w") as handle:
        json.dump(result, handle)
    return result


def main() -> None:
    out_dir = sys.argv[1]
    for name in ("clean", "forward", "backward"):
        run(name, out_dir)
    import torch.distributed as dist

    if dist.is_initialized():  # as train_sequence_parallel.py: gloo's threads end here, not in the exit's teardown
        dist.barrier()
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
