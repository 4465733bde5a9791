"""MemFitTrainer on the CPU: planning, applying, verifying and recovering from an injected OOM."""

import json
import math

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM, HfArgumentParser, TrainerCallback, TrainingArguments

from hf_memfit.integrations.args import MemFitArguments
from hf_memfit.errors import MemFitError
from hf_memfit.integrations.trainer import MemFitTrainer

SEQ = 32


def tiny_gpt2():
    torch.manual_seed(0)
    config = AutoConfig.for_model("gpt2", n_layer=2, n_embd=32, n_head=2, vocab_size=128, n_positions=64,
                                  bos_token_id=0, eos_token_id=0, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    return AutoModelForCausalLM.from_config(config)


class TokenDataset(torch.utils.data.Dataset):
    def __init__(self, n=32):
        generator = torch.Generator().manual_seed(1)
        self.ids = torch.randint(0, 128, (n, SEQ), generator=generator)

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def make_args(tmp_path, **overrides):
    values = dict(output_dir=str(tmp_path / "out"), memory_budget="2GiB", per_device_train_batch_size=4,
                  gradient_accumulation_steps=2, max_steps=3, learning_rate=1e-3, report_to=[], save_strategy="no",
                  use_cpu=True, seed=0, data_seed=0, logging_steps=1, disable_tqdm=True)
    values.update(overrides)
    return MemFitArguments(**values)


def test_plans_applies_and_writes_the_plan(tmp_path):
    trainer = MemFitTrainer(model=tiny_gpt2(), args=make_args(tmp_path), train_dataset=TokenDataset())
    plan = trainer.memfit_plan
    assert plan.per_device_train_batch_size * plan.gradient_accumulation_steps == 8  # global batch kept
    assert trainer.args.per_device_train_batch_size == plan.per_device_train_batch_size
    assert trainer.args.gradient_accumulation_steps == plan.gradient_accumulation_steps
    trainer.train()
    saved = json.loads((tmp_path / "out" / "memfit_plan.json").read_text())
    assert saved["plan"]["per_device_train_batch_size"] == plan.per_device_train_batch_size
    checks = [h for h in trainer.state.log_history if "memfit/measured_peak_bytes" in h]
    assert checks and checks[0]["memfit/measured_peak_bytes"] > 0
    assert abs(checks[0]["memfit/relative_error"]) < 0.10  # the warning threshold


def test_a_tight_budget_lowers_the_micro_batch(tmp_path):
    roomy = MemFitTrainer(model=tiny_gpt2(), args=make_args(tmp_path), train_dataset=TokenDataset())
    need = roomy.memfit_result.estimate.device_total_bytes
    tight = MemFitTrainer(model=tiny_gpt2(), args=make_args(tmp_path, memory_budget=str(int(need * 0.97 / 0.95))),
                          train_dataset=TokenDataset())
    budget = int(need * 0.97 / 0.95)
    assert tight.memfit_result.estimate.device_total_bytes <= budget * 0.95
    knobs = lambda p: (p.per_device_train_batch_size, p.gradient_checkpointing, p.optim)  # noqa: E731
    assert knobs(tight.memfit_plan) != knobs(roomy.memfit_plan)  # something had to give
    assert tight.args.optim == tight.memfit_plan.optim


def _train_weights(tmp_path, fail_above: int | None):
    model = tiny_gpt2()
    calls = {"raised": 0}

    def fake_oom(module, args):
        if fail_above is not None and args[0].shape[0] > fail_above:
            calls["raised"] += 1
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    model.transformer.h[1].register_forward_pre_hook(fake_oom)
    trainer = MemFitTrainer(model=model, args=make_args(tmp_path), train_dataset=TokenDataset())
    trainer.train()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}, trainer, calls["raised"]


def test_oom_recovery_keeps_the_training_identical(tmp_path):
    clean, _, _ = _train_weights(tmp_path / "clean", fail_above=None)
    recovered, trainer, raised = _train_weights(tmp_path / "faulty", fail_above=2)
    assert raised >= 1
    assert any("memfit/oom_recovery" in h for h in trainer.state.log_history)
    assert trainer.state.global_step == 3
    for name, value in clean.items():
        # Chunked gradients differ from whole ones only by float rounding, which Adam
        # can amplify for near-zero gradients; a skipped or repeated micro-batch moves
        # weights by ~lr (1e-3), far outside this tolerance.
        torch.testing.assert_close(recovered[name], value, rtol=0, atol=2e-5, msg=name)


def test_gives_up_after_the_ladder_with_a_checkpoint(tmp_path):
    model = tiny_gpt2()

    def always_oom(module, args):
        raise torch.OutOfMemoryError("CUDA out of memory.")

    model.transformer.h[0].register_forward_pre_hook(always_oom)
    trainer = MemFitTrainer(model=model, args=make_args(tmp_path), train_dataset=TokenDataset())
    with pytest.raises(MemFitError, match="checkpoint"):
        trainer.train()
    # the memory check's dispatch mode is uninstalled, not left counting every later op in the process
    from torch.utils._python_dispatch import _get_current_dispatch_mode

    assert _get_current_dispatch_mode() is None and trainer._memfit_check.tracker == "done"
    assert any(p.name.startswith("checkpoint-") for p in (tmp_path / "out").iterdir())
    postmortem = json.loads((tmp_path / "out" / "memfit_postmortem.json").read_text())
    assert postmortem["reason"].startswith("out of memory")
    assert postmortem["predicted"]["breakdown"]["weights"] > 0


def test_debug_memory_writes_a_postmortem_on_the_cpu(tmp_path):
    trainer = MemFitTrainer(model=tiny_gpt2(), args=make_args(tmp_path, memfit_debug_memory=True),
                            train_dataset=TokenDataset())
    trainer.train()
    report = json.loads((tmp_path / "out" / "memfit_postmortem.json").read_text())
    assert report["predicted"]["peak_allocated_bytes"] > 0
    assert any("memfit/measured_peak_bytes" in entry for entry in report["measured"])
    assert "snapshot" not in report  # the CUDA snapshot needs a GPU


@pytest.mark.gpu
def test_debug_memory_writes_a_cuda_snapshot(tmp_path):
    args = make_args(tmp_path, memfit_debug_memory=True, use_cpu=False, memory_budget="auto")
    trainer = MemFitTrainer(model=tiny_gpt2().cuda(), args=args, train_dataset=TokenDataset())
    trainer.train()
    assert (tmp_path / "out" / "memfit_memory_snapshot.pickle").stat().st_size > 0


def test_plain_training_arguments_are_upcast(tmp_path):
    args = TrainingArguments(output_dir=str(tmp_path / "o"), per_device_train_batch_size=2, use_cpu=True,
                             report_to=[], max_steps=1)
    with pytest.raises(MemFitError, match="memory_budget"):  # the default budget is "auto", and there is no GPU
        MemFitTrainer(model=tiny_gpt2(), args=args, train_dataset=TokenDataset())
    assert not (tmp_path / "o").exists()  # nothing half-written


def test_bad_global_batch_fails_before_training(tmp_path):
    with pytest.raises(MemFitError, match="global"):
        MemFitTrainer(model=tiny_gpt2(), args=make_args(tmp_path, global_batch_size=0), train_dataset=TokenDataset())
    assert not (tmp_path / "out").exists()


def test_hf_argument_parser_gives_flags():
    (args,) = HfArgumentParser(MemFitArguments).parse_args_into_dataclasses(
        ["--output_dir", "/tmp/x", "--memory_budget", "24GiB", "--global_batch_size", "64", "--memfit_mode", "exact",
         "--use_cpu", "True"])
    assert args.memory_budget == "24GiB" and args.global_batch_size == 64 and args.memfit_mode == "exact"


def _weights(model):
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


class StopAfter(TrainerCallback):
    def __init__(self, step):
        self.step = step

    def on_step_end(self, args, state, control, **kwargs):
        control.should_training_stop = state.global_step >= self.step


def test_resume_keeps_the_plan_and_the_training(tmp_path):
    roomy = dict(memory_budget="2GiB", max_steps=4, save_strategy="steps", save_steps=2)
    clean = MemFitTrainer(model=tiny_gpt2(), args=make_args(tmp_path / "clean", **roomy), train_dataset=TokenDataset())
    clean.train()
    first = MemFitTrainer(model=tiny_gpt2(), args=make_args(tmp_path / "resumed", **roomy),
                          train_dataset=TokenDataset(), callbacks=[StopAfter(2)])  # interrupted: same schedule
    first.train()
    saved = json.loads((tmp_path / "resumed" / "out" / "checkpoint-2" / "memfit_state.json").read_text())
    assert saved["knobs"]["per_device_train_batch_size"] == first.memfit_plan.per_device_train_batch_size

    # Today's budget would plan differently; the resumed run must keep the checkpoint's plan.
    need = first.memfit_result.estimate.device_total_bytes
    tight = make_args(tmp_path / "resumed", **{**roomy, "memory_budget": str(int(need * 0.97 / 0.95))})
    resumed = MemFitTrainer(model=tiny_gpt2(), args=tight, train_dataset=TokenDataset())
    assert resumed.args.per_device_train_batch_size != saved["knobs"]["per_device_train_batch_size"] or \
        resumed.args.gradient_checkpointing != saved["knobs"]["gradient_checkpointing"] or \
        resumed.args.optim != saved["knobs"]["optim"]
    resumed.train(resume_from_checkpoint=True)
    for name in ("per_device_train_batch_size", "gradient_accumulation_steps", "gradient_checkpointing"):
        assert getattr(resumed.args, name) == saved["knobs"][name], name
    assert resumed.state.global_step == 4
    ours, theirs = _weights(resumed.model), _weights(clean.model)
    for name, value in theirs.items():
        torch.testing.assert_close(ours[name], value, rtol=0, atol=1e-6, msg=name)


def test_resume_restores_the_optimizer_arguments(tmp_path):
    # The optimizer's state only loads into the same optimizer, built with the same arguments.
    trainer = MemFitTrainer(model=tiny_gpt2(), args=make_args(tmp_path), train_dataset=TokenDataset())
    state = trainer.memfit_state()
    assert {"optim_args", "optim_target_modules", "gradient_checkpointing_kwargs"} <= set(state["knobs"])
    state["knobs"].update(optim_args="bf16_stochastic_round=True", gradient_checkpointing=True,
                          gradient_checkpointing_kwargs={"use_reentrant": False})
    folder = tmp_path / "checkpoint-7"
    folder.mkdir()
    (folder / "memfit_state.json").write_text(json.dumps(state))
    trainer._restore_plan(str(folder))
    assert trainer.args.optim_args == "bf16_stochastic_round=True"
    assert trainer.args.gradient_checkpointing_kwargs == {"use_reentrant": False}
    # a checkpoint written before these knobs were saved still resumes
    del state["knobs"]["optim_args"]
    (folder / "memfit_state.json").write_text(json.dumps(state))
    trainer._restore_plan(str(folder))


def test_an_oom_step_down_survives_resume(tmp_path):
    model = tiny_gpt2()

    def fake_oom(module, args):
        if args[0].shape[0] > 2:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    model.transformer.h[1].register_forward_pre_hook(fake_oom)
    trainer = MemFitTrainer(model=model, args=make_args(tmp_path, max_steps=2, save_strategy="steps", save_steps=2),
                            train_dataset=TokenDataset())
    trainer.train()
    saved = json.loads((tmp_path / "out" / "checkpoint-2" / "memfit_state.json").read_text())
    # the hook fails above 2 samples: the ladder halves the micro-batch until chunks of 2 run
    assert saved["micro_batch_chunk"] == 2 and saved["recoveries"] == trainer._memfit_recoveries >= 1
    resumed = MemFitTrainer(model=tiny_gpt2(), args=make_args(tmp_path, max_steps=3), train_dataset=TokenDataset())
    resumed.train(resume_from_checkpoint=True)
    assert resumed._memfit_chunk == 2 and resumed.state.global_step == 3


def _tiny_gpt2_lora():
    from peft import LoraConfig, get_peft_model

    return get_peft_model(tiny_gpt2(), LoraConfig(r=4, lora_alpha=8, target_modules=["c_attn"], task_type="CAUSAL_LM"))


def test_lora_model_is_planned_as_lora_and_checked(tmp_path):
    model = _tiny_gpt2_lora()
    trainer = MemFitTrainer(model=model, args=make_args(tmp_path), train_dataset=TokenDataset())
    estimate = trainer.memfit_result.estimate
    assert estimate.settings.lora_r == 4 and estimate.settings.lora_target_modules == ("c_attn",)
    assert estimate.trainable_params == sum(p.numel() for p in model.parameters() if p.requires_grad)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    trainer.train()
    for name, param in model.named_parameters():  # only the adapters move
        assert torch.equal(param, before[name]) != param.requires_grad, name
    check = next(h for h in trainer.state.log_history if "memfit/relative_error" in h)
    assert abs(check["memfit/relative_error"]) < 0.10


def test_eight_bit_adam_runs_for_real_and_is_predicted(tmp_path):
    trainer = MemFitTrainer(model=tiny_gpt2(), args=make_args(tmp_path, optim="adamw_bnb_8bit", keep_optimizer=True),
                            train_dataset=TokenDataset())
    assert trainer.memfit_plan.optim == "adamw_bnb_8bit"
    trainer.train()
    assert type(trainer.optimizer.optimizer).__module__.startswith("bitsandbytes.optim")  # AdamW(optim_bits=8)
    states = [s for s in trainer.optimizer.optimizer.state.values() if "state1" in s]
    assert any(s["state1"].dtype == torch.uint8 for s in states)  # 8-bit states, not a fallback
    check = next(h for h in trainer.state.log_history if "memfit/relative_error" in h)
    assert abs(check["memfit/relative_error"]) < 0.10


def test_planned_checkpointing_is_applied_to_the_run(tmp_path):
    # transformers 5 resolves the deprecated `gradient_checkpointing` from `activation_checkpointing`:
    # a plan that turns checkpointing on must reach the Trainer under the name it reads.
    # Global batch 1 and a fixed optimizer leave two candidates: checkpointing off or on.
    knobs = dict(per_device_train_batch_size=1, gradient_accumulation_steps=1, keep_optimizer=True)
    roomy = MemFitTrainer(model=tiny_gpt2(), args=make_args(tmp_path, **knobs), train_dataset=TokenDataset())
    assert not roomy.memfit_plan.gradient_checkpointing
    with_checkpointing = next(c for c in roomy.memfit_result.alternatives if c.settings.gradient_checkpointing)
    need_off = roomy.memfit_result.estimate.device_total_bytes
    need_on = with_checkpointing.estimate.device_total_bytes
    assert need_on < need_off
    budget = (need_on + need_off) // 2 / 0.95  # only the checkpointed step fits (5% headroom)
    trainer = MemFitTrainer(model=tiny_gpt2(), args=make_args(tmp_path / "tight", memory_budget=str(int(budget)),
                                                              **knobs), train_dataset=TokenDataset())
    assert trainer.memfit_plan.gradient_checkpointing
    assert trainer.args.gradient_checkpointing and getattr(trainer.args, "activation_checkpointing", True)
    trainer.train()
    assert trainer.model.is_gradient_checkpointing


class LabelledDataset(torch.utils.data.Dataset):
    def __init__(self, n=32):
        generator = torch.Generator().manual_seed(2)
        self.ids = torch.randint(0, 128, (n, SEQ), generator=generator)
        self.labels = torch.randint(0, 2, (n,), generator=generator)

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.labels[i]}


def tiny_classifier():
    from transformers import AutoModelForSequenceClassification

    torch.manual_seed(0)
    config = AutoConfig.for_model("bert", num_hidden_layers=2, hidden_size=32, intermediate_size=64,
                                  num_attention_heads=2, vocab_size=128, max_position_embeddings=64,
                                  hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    return AutoModelForSequenceClassification.from_config(config)


def _train_classifier(tmp_path, fail_above: int | None = None):
    model = tiny_classifier()
    if fail_above is not None:
        def fake_oom(module, args):
            if args[0].shape[0] > fail_above:
                raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

        model.bert.encoder.layer[1].register_forward_pre_hook(fake_oom)
    # SGD: its update scales with the gradient, so a mis-scaled loss shows in the weights (Adam would hide it)
    args = make_args(tmp_path, per_device_train_batch_size=8, gradient_accumulation_steps=1, max_grad_norm=0.0,
                     optim="sgd", keep_optimizer=True, learning_rate=0.1)
    trainer = MemFitTrainer(model=model, args=args, train_dataset=LabelledDataset())
    trainer.train()
    return trainer, _weights(model)


def test_classification_loss_is_a_mean_through_oom_chunks(tmp_path):
    # transformers 5 skips dividing the loss by the accumulation steps for any model whose forward
    # takes **kwargs; BERT's classification loss is a plain mean, so accumulation (or the chunks of
    # an OOM recovery) would multiply loss and gradients. MemFitTrainer keeps them a mean.
    _, clean = _train_classifier(tmp_path / "clean")
    trainer, recovered = _train_classifier(tmp_path / "faulty", fail_above=2)
    assert trainer._memfit_chunk == 2  # the step ran as 4 chunks of 2
    first = next(h["loss"] for h in trainer.state.log_history if "loss" in h)
    assert abs(first - math.log(2)) < 0.15  # an untrained 2-way head: about ln 2, not 4 x ln 2
    for name, value in clean.items():
        torch.testing.assert_close(recovered[name], value, rtol=0, atol=2e-5, msg=name)


@pytest.mark.parametrize("env, layout, fsdp_layout", [
    # accelerate's FSDP plugin: FSDP_VERSION unset means FSDP1, its strategy FULL_SHARD
    ({"ACCELERATE_USE_FSDP": "true"}, None, ("full_shard", 1, False)),
    ({"ACCELERATE_USE_FSDP": "true", "FSDP_OFFLOAD_PARAMS": "true"}, None, ("full_shard", 1, True)),
    ({"ACCELERATE_USE_FSDP": "true", "FSDP_VERSION": "2", "FSDP_RESHARD_AFTER_FORWARD": "false"}, None,
     ("shard_grad_op", 2, False)),
    ({"ACCELERATE_USE_DEEPSPEED": "true", "ACCELERATE_DEEPSPEED_ZERO_STAGE": "2",
      "ACCELERATE_DEEPSPEED_OFFLOAD_OPTIMIZER_DEVICE": "cpu"}, (2, "cpu", "none"), None),
    ({}, None, None),
])
def test_the_launchers_sharding_fixes_the_layout(tmp_path, monkeypatch, env, layout, fsdp_layout):
    from hf_memfit.integrations.introspect import fixed_layout as _fixed_layout, fsdp_layout as _fsdp_layout

    for name in ("ACCELERATE_USE_FSDP", "FSDP_OFFLOAD_PARAMS", "ACCELERATE_USE_DEEPSPEED", "FSDP_VERSION",
                 "FSDP_RESHARD_AFTER_FORWARD", "FSDP_SHARDING_STRATEGY"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    args = make_args(tmp_path)
    assert _fixed_layout(args) == layout
    assert _fsdp_layout(args) == fsdp_layout


def test_a_bf16_lora_plan_loads_in_bf16():
    from hf_memfit.planner.search import plan

    result = plan("gpt2", gpu_memory="8GiB", seq_len=256, global_batch_size=8, lora_r=8, precision="bf16")
    assert result.plan.torch_dtype == "bfloat16"
    assert plan("gpt2", gpu_memory="8GiB", seq_len=256, global_batch_size=8).plan.torch_dtype == "float32"  # autocast


def test_fsdp_on_the_cpu_is_planned_as_the_ddp_accelerate_runs(tmp_path, monkeypatch):
    # accelerate promotes only GPU runs to FSDP: on the CPU, a launched run with `fsdp` set trains under DDP.
    from hf_memfit.integrations.introspect import fsdp_layout_run

    monkeypatch.delenv("ACCELERATE_USE_FSDP", raising=False)
    args = TrainingArguments(output_dir=str(tmp_path), fsdp="full_shard", use_cpu=True, report_to=[])
    notes = []
    assert fsdp_layout_run(args, on_gpu=False, notes=notes) is None
    assert notes and "accelerate runs DDP" in notes[0]
    assert fsdp_layout_run(args, on_gpu=True, notes=[]) == ("full_shard", 2, False)


def test_a_layerwise_optimizer_is_planned_at_accumulation_1_and_an_oom_is_not_redone(tmp_path):
    """Layerwise GaLore steps parameters inside backward: the plan takes the global batch in one micro-batch,
    and an OOM (after part of the update) stops with a clear error instead of redoing the step."""
    model = tiny_gpt2()
    args = make_args(tmp_path, optim="galore_adamw_layerwise", optim_target_modules="all-linear",
                     optim_args="rank=8")
    trainer = MemFitTrainer(model=model, args=args, train_dataset=TokenDataset())
    assert trainer.memfit_plan.optim == "galore_adamw_layerwise"
    assert (trainer.args.per_device_train_batch_size, trainer.args.gradient_accumulation_steps) == (8, 1)

    def fake_oom(module, grad_input, grad_output):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    model.transformer.h[0].register_full_backward_hook(fake_oom)
    with pytest.raises(MemFitError, match="updates each parameter inside backward"):
        trainer.train()
