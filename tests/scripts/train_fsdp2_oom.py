"""MemFitTrainer under FSDP2 (`fully_shard`) on the CPU over gloo, 2 processes, with an OOM on one rank only.

    accelerate launch --multi_gpu --num_processes 2 tests/scripts/train_fsdp2_oom.py OUT_DIR

accelerate 1.15 promotes a run to FSDP only on GPU-like devices (`AcceleratorState.__init__`:
MULTI_CPU is not among them) and trains a CPU run with FSDP set as DDP. `CpuFsdp2Trainer` sets
the state to FSDP with the plugin the Trainer built, as accelerate does on a GPU; from there
accelerate's own `fsdp2_prepare_model` and torch's `fully_shard` run for real, over gloo
(torch documents `fully_shard` on a CPU mesh).

Two runs of the same tiny GPT-2 (dropout off); accelerate makes the embedding, each block, the
final norm, the LM head and the root FSDP units:
- clean: no fault;
- forward: rank 1 runs out of memory in the LM head (where the logits are made) for any
  micro-batch over 2 samples, and once more in the third chunk of 2 in step 1 (two chunks
  already done). The LM head's all-gather is the forward's last, so the other rank runs on to
  the agreement at the end of the forward, which rank 1 joins. An OOM before a later all-gather
  (in a block) cannot be joined: rank 1 then stops alone and the launcher ends rank 0, blocked
  in that all-gather (see `hf_memfit/integrations/recovery.py`).
- alone (`... OUT_DIR alone`, its own launch): rank 1 runs out of memory in a backward of step 1, where rank 0
  is inside FSDP's collectives: rank 1 stops with the command that resumes, and the launch ends rank 0.
Each rank saves the gathered final weights to OUT_DIR/<run>-rank<r>.pt and its result to OUT_DIR/<run>-rank<r>.json.
"""

import json
import sys

import torch
from transformers import AutoConfig, AutoModelForCausalLM

from hf_memfit import MemFitArguments, MemFitTrainer
from hf_memfit.errors import MemFitError

SEQ, VOCAB = 32, 128


class TokenDataset(torch.utils.data.Dataset):
    def __init__(self, n=64):
        self.ids = torch.randint(0, VOCAB, (n, SEQ), generator=torch.Generator().manual_seed(1))

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


class CpuFsdp2Trainer(MemFitTrainer):
    def create_accelerator_and_postprocess(self):
        from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin

        super().create_accelerator_and_postprocess()
        state = self.accelerator.state
        state.fsdp_plugin = FullyShardedDataParallelPlugin(**self.args.fsdp_plugin_args)
        state.distributed_type = DistributedType.FSDP
        self.is_fsdp_enabled = True


def tiny_gpt2():
    torch.manual_seed(0)
    config = AutoConfig.for_model("gpt2", n_layer=2, n_embd=32, n_head=2, vocab_size=VOCAB, n_positions=64,
                                  bos_token_id=0, eos_token_id=0, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                                  tie_word_embeddings=False)
    return AutoModelForCausalLM.from_config(config)


def oom() -> torch.OutOfMemoryError:
    return torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB (injected)")


def run(name: str, out_dir: str) -> dict:
    model = tiny_gpt2()
    args = MemFitArguments(output_dir=f"{out_dir}/{name}", memory_budget="2GiB", per_device_train_batch_size=4,
                           gradient_accumulation_steps=2, max_steps=3, learning_rate=1e-3, report_to=[],
                           save_strategy="no", use_cpu=True, seed=0, data_seed=0, logging_steps=1, disable_tqdm=True,
                           fsdp="full_shard", fsdp_config={"version": 2, "transformer_layer_cls_to_wrap": ["GPT2Block"],
                                                           "reshard_after_forward": True})
    trainer = CpuFsdp2Trainer(model=model, args=args, train_dataset=TokenDataset())
    rank = trainer.args.process_index
    if name == "forward" and rank == 1:
        seen = {"step": -1, "calls": 0, "fired": False}

        def fail_forward(module, inputs):
            if inputs[0].shape[0] > 2:
                raise oom()
            if trainer.state.global_step != seen["step"]:
                seen["step"], seen["calls"] = trainer.state.global_step, 0
            seen["calls"] += 1
            if not seen["fired"] and trainer.state.global_step == 1 and seen["calls"] == 3:
                seen["fired"] = True
                raise oom()

        model.lm_head.register_forward_pre_hook(fail_forward)  # runs after FSDP's own pre-forward: gathered
    if name == "alone" and rank == 1:
        def fail_backward(module, grad_output):
            if trainer.state.global_step == 1:
                raise oom()

        model.transformer.h[0].register_full_backward_pre_hook(fail_backward)
    try:
        trainer.train()
    except MemFitError as error:  # recorded for the test, then the rank stops as it would
        with open(f"{out_dir}/{name}-rank{rank}-error.txt", "w") as handle:
            handle.write(str(error))
        raise
    from torch.distributed.fsdp import FSDPModule

    sharded = any(isinstance(m, FSDPModule) for m in trainer.model.modules())
    state = {k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().clone()
             for k, v in trainer.model.state_dict().items()}
    torch.save(state, f"{out_dir}/{name}-rank{rank}.pt")
    result = {"run": name, "rank": rank, "world_size": trainer.args.world_size, "sharded": sharded,
              "layout": trainer.memfit_layout, "recoveries": trainer._memfit_recoveries,
              "chunk": trainer._memfit_chunk, "global_step": trainer.state.global_step,
              "switches": [h["memfit/change"] for h in trainer.state.log_history if "memfit/change" in h]}
    with open(f"{out_dir}/{name}-rank{rank}.json", "w") as handle:
        json.dump(result, handle)
    return result


def main() -> None:
    for name in sys.argv[2:] or ("clean", "forward"):
        run(name, sys.argv[1])
    import torch.distributed as dist

    if dist.is_initialized():
        # Both ranks leave together and end gloo's threads here: left to the interpreter's teardown, a rank once
        # aborted after writing its results ("terminate called without an active exception"), failing the launch.
        dist.barrier()
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
