"""The one optimizer model: state layouts against the real libraries, both modes agreeing, the planner's levers."""

import pytest
import torch

from hf_memfit import optimizers
from hf_memfit.errors import MemFitError
from hf_memfit.estimator.fast import fast_step_memory
from hf_memfit.optimizers import TensorGroup, state_bytes
from hf_memfit.planner.search import plan
from hf_memfit.settings import TrainSettings
from hf_memfit.estimator.exact import exact_candidates
from hf_memfit.units import GiB

# Quantized (>= 4096 elements and a multiple of the 256-element block) and not: 1000 elements is too small,
# 100 x 100 = 10000 is not a multiple of 256, so both keep zeros_like(param) states.
SHAPES = [(1024, 1024), (512, 1024), (1000,), (100, 100)]


def _real_torchao_state_bytes(optim: str, dtype: torch.dtype) -> int:
    """Bytes of the states torchao's own `_new_buffer` makes, in the optimizer the HF Trainer builds."""
    from hf_memfit.estimator.step import trainer_optimizer_class

    cls, kwargs = trainer_optimizer_class(TrainSettings(optim=optim, device="cpu"))
    params = [torch.nn.Parameter(torch.zeros(shape, dtype=dtype)) for shape in SHAPES]
    opt = cls(params, **kwargs)
    total = 0
    for p in params:
        for signed in (True, False):
            buffer = opt._new_buffer(p, signed)
            inner = [getattr(buffer, name) for name in getattr(buffer, "tensor_attrs", ())] or [buffer]
            total += sum(t.untyped_storage().nbytes() for t in inner)
        total += torch.tensor(0.0).untyped_storage().nbytes()  # state["step"]
    return total


@pytest.mark.parametrize("optim", ["adamw_torch_8bit", "adamw_torch_4bit"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_torchao_state_layout_matches_the_library(optim, dtype):
    size = torch.tensor([], dtype=dtype).element_size()
    predicted = sum(state_bytes(TensorGroup(shape, 1, size), optim, cuda=False) for shape in SHAPES)
    assert predicted == _real_torchao_state_bytes(optim, dtype)


def test_torchao_state_sizes_per_parameter():
    big = TensorGroup((4096, 4096), 1, 2)
    # 8-bit: 2 x (1 B codes + 4 B scale per 256) ~ 2.03 B/param; 4-bit: half the codes.
    assert state_bytes(big, "adamw_torch_8bit", cuda=True) == 2 * (4096 * 4096 + 4096 * 4096 // 256 * 4 + 1024)
    assert state_bytes(big, "adamw_torch_4bit", cuda=True) == 2 * (4096 * 4096 // 2 + 4096 * 4096 // 256 * 4 + 512)
    # bf16 weights under fused AdamW: states in the weights' dtype, 4 B/param
    assert state_bytes(big, "adamw_torch_fused", cuda=True) == 2 * 4096 * 4096 * 2 + 512


def test_torchao_step_buffers_are_one_tensor_at_a_time():
    tensors = [TensorGroup((1024, 1024), 3, 4), TensorGroup((512, 1024), 2, 4), TensorGroup((1000,), 1, 4)]
    assert optimizers.tensors_step_temporary_bytes(tensors, "adamw_torch_8bit", "cuda") == 8 * 1024 * 1024
    assert optimizers.tensors_step_temporary_bytes(tensors, "adamw_torch_4bit", "cpu") == 26 * 1024 * 1024


@pytest.mark.parametrize("optim,precision,device", [
    ("adamw_torch_8bit", "fp32", "cpu"),
    ("adamw_torch_4bit", "bf16", "cuda"),
    ("adamw_bnb_8bit", "bf16", "cuda"),
])
def test_fast_and_exact_agree_on_low_bit_adamw(tiny_specs, optim, precision, device):
    spec = tiny_specs["llama"]
    settings = TrainSettings(batch_size=2, seq_len=32, device=device, optim=optim, precision=precision,
                             optim_args="bf16_stochastic_round=True" if precision == "bf16" else None).validate(spec)
    fast, exact = fast_step_memory(spec, settings), exact_candidates(spec, settings)
    assert abs(fast.peak_bytes - exact.peak_bytes) <= 0.005 * exact.peak_bytes
    assert max(b["optimizer"] for b in fast.candidates.values()) == \
        max(b["optimizer"] for b in exact.candidates.values())


def test_unknown_optimizer_is_one_line():
    with pytest.raises(MemFitError, match="`--optim` 'adamw_9bit' is not modelled"):
        optimizers.get("adamw_9bit")


# --- pure bf16 in the planner ------------------------------------------------------------------

GPT2XL_16GB_HOST = dict(gpu="rtx3060", cpu_memory="16GiB", seq_len=1024, global_batch_size=64)


def test_gpt2_xl_on_a_12_gb_card_with_16_gb_of_ram_needs_pure_bf16():
    with pytest.raises(MemFitError) as refused:
        plan("gpt2-xl", **GPT2XL_16GB_HOST)
    message = str(refused.value)
    assert "host memory" in message and "16.00 GiB" in message
    assert "`--allow-pure-bf16` (" in message

    result = plan("gpt2-xl", allow_pure_bf16=True, **GPT2XL_16GB_HOST)
    p, est = result.plan, result.estimate
    assert p.settings.precision == "bf16" and p.torch_dtype == "bfloat16"
    assert p.optim in optimizers.PURE_BF16_LADDER
    assert p.training_arguments()["optim_args"] == "bf16_stochastic_round=True"
    # trained without autocast, as estimated (autocast would run layer norms in fp32 over bf16 weights)
    assert p.training_arguments()["bf16"] is False and p.training_arguments()["fp16"] is False
    assert est.settings.autocast_dtype is None
    assert est.device_total_bytes <= 0.95 * p.budget_bytes and est.cpu_bytes <= 16 * GiB
    assert est.trainable_params == est.total_params  # still a full fine-tune
    assert any("stochastic" in r and "no fp32 master copy" in r for r in p.reasons)


def test_pure_bf16_is_never_chosen_silently_or_when_mixed_fits():
    # Fits with mixed precision: the flag changes nothing.
    allowed = plan("gpt2-large", gpu_memory="24GiB", seq_len=1024, global_batch_size=32, allow_pure_bf16=True)
    default = plan("gpt2-large", gpu_memory="24GiB", seq_len=1024, global_batch_size=32)
    assert allowed.plan.settings.precision == default.plan.settings.precision == "bf16-mixed"
    assert allowed.plan.optim_args is None


def test_low_rank_and_adafactor_need_allowing(tiny_specs):
    spec = tiny_specs["llama"]
    budget = "3MiB"
    common = dict(seq_len=32, global_batch_size=2, gpu_memory=budget, device="cpu")
    with pytest.raises(MemFitError):
        plan(spec, **common)
    result = plan(spec, allow_optimizers="adafactor", **common)
    assert result.plan.optim == "adafactor"
    assert any("allowed by `--allow-optimizers`" in r for r in result.plan.reasons)


def test_gpt2xl_recipe_plans_the_16_gb_ram_machine_with_the_flag():
    from hf_memfit.integrations.recipe import REPO, execute, load_recipe_module

    recipe = load_recipe_module(REPO / "recipes" / "gpt2xl_12gb.py").RECIPE
    with pytest.raises(MemFitError, match="allow-pure-bf16"):
        execute(recipe, ["--dry-run", "--cpu_memory", "16GiB"])
    result = execute(recipe, ["--dry-run", "--cpu_memory", "16GiB", "--allow_pure_bf16"])
    assert result.plan.settings.precision == "bf16" and result.estimate.cpu_bytes <= 16 * GiB


# --- GaLore 8-bit and APOLLO in exact mode (issue 13) ----------------------------------------------

@pytest.mark.parametrize("optim,precision", [("galore_adamw_8bit", "fp32"), ("galore_adamw_8bit", "bf16"),
                                             ("apollo_adamw", "fp32"), ("apollo_adamw", "bf16")])
def test_low_rank_exact_mode_on_the_cpu_allocator(tiny_specs, optim, precision):
    """The real GaLoreAdamW8bit / APOLLOAdamW step, measured; exact mode traces the same objects."""
    from bitsandbytes.optim import GlobalOptimManager

    from hf_memfit.estimator.measure import measure_cpu_peak

    # bitsandbytes keeps per-(group, index) overrides in a process-wide singleton: a Trainer run earlier in this
    # process (which registers fp32 states for its embeddings) would change which of these tensors get 8-bit states
    GlobalOptimManager.get_instance().initialize()

    spec = tiny_specs["llama"]
    settings = TrainSettings(batch_size=1, seq_len=16, device="cpu", optim=optim, precision=precision,
                             optim_args="rank=16", optim_target_modules=("all-linear",)).validate(spec)
    measured = measure_cpu_peak(spec.with_layers(spec.num_layers), settings)
    exact, fast = exact_candidates(spec, settings), fast_step_memory(spec, settings)
    assert exact.peak_region.endswith("|opt")  # the optimizer step is the peak at this size: it is what is checked
    assert abs(exact.peak_bytes - measured) <= 0.002 * measured
    assert abs(fast.peak_bytes - exact.peak_bytes) <= 0.02 * exact.peak_bytes


def test_apollo_projects_a_narrow_tensor_up_to_its_rank():
    """APOLLO draws a (short x rank) Gaussian whatever the shape; GaLore's SVD slice stops at the short side."""
    narrow = TensorGroup((64, 256), 1, 4, low_rank_target=True)
    # states long x rank (256 x 128) twice, the 64 x 128 projector, the 0-d fp32 limiter state
    assert state_bytes(narrow, "apollo_adamw", cuda=False, optim_args="rank=128") == \
        2 * 256 * 128 * 4 + 64 * 128 * 4 + 4
    # GaLore: rank min(128, 64) = 64; fp32 keeps the whole 64 x 64 factor the slice views
    assert state_bytes(narrow, "galore_adamw", cuda=False, optim_args="rank=128") == 2 * 256 * 64 * 4 + 64 * 64 * 4


# --- layerwise GaLore / APOLLO (issue 13) ------------------------------------------------------------

LAYERWISE = ["galore_adamw_layerwise", "galore_adamw_8bit_layerwise", "apollo_adamw_layerwise"]


def _tiny_rows(seq_len: int, vocab: int):
    class Rows(torch.utils.data.Dataset):
        def __len__(self):
            return 64

        def __getitem__(self, i):
            ids = torch.randint(0, vocab, (seq_len,), generator=torch.Generator().manual_seed(i))
            return {"input_ids": ids, "labels": ids.clone()}

    return Rows()


def test_layerwise_with_the_real_trainer_on_the_cpu_allocator(tiny_specs, tmp_path):
    """`Trainer(optim="galore_adamw_layerwise")`: steps inside backward through its own hooks, measured."""
    from hf_memfit.estimator.measure import allocator_peak, profiled_allocations
    from transformers import AutoConfig, AutoModelForCausalLM, Trainer, TrainingArguments

    from tests.conftest import TINY_LLAMA

    spec = tiny_specs["llama"]
    args = TrainingArguments(output_dir=str(tmp_path), optim="galore_adamw_layerwise", optim_args="rank=16",
                             optim_target_modules="all-linear", per_device_train_batch_size=2, max_steps=2,
                             use_cpu=True, report_to=[], save_strategy="no", disable_tqdm=True)
    torch.manual_seed(0)
    with profiled_allocations() as prof:
        model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**TINY_LLAMA), dtype=torch.float32)
        trainer = Trainer(model=model, args=args, train_dataset=_tiny_rows(32, TINY_LLAMA["vocab_size"]))
        trainer.train()
        assert all(p.grad is None for p in model.parameters())  # every gradient was freed by its hook
        del trainer, model
    measured = allocator_peak(prof)
    settings = TrainSettings(batch_size=2, seq_len=32, device="cpu", optim="galore_adamw_layerwise",
                             optim_args="rank=16", optim_target_modules=("all-linear",)).validate(spec)
    exact, fast = exact_candidates(spec, settings), fast_step_memory(spec, settings)
    assert abs(exact.peak_bytes - measured) <= 0.005 * measured
    assert abs(fast.peak_bytes - measured) <= 0.02 * measured
    # no gradients outlive their step: the step after backward holds none
    assert exact.candidates["1.0|opt"]["gradients"] == fast.candidates["1.0|opt"]["gradients"] == 0


@pytest.mark.parametrize("optim,precision,device,checkpointing", [
    ("galore_adamw_8bit_layerwise", "fp32", "cpu", False),
    ("galore_adamw_8bit_layerwise", "bf16", "cuda", True),
    ("apollo_adamw_layerwise", "bf16-mixed", "cuda", True),
    ("apollo_adamw_layerwise", "fp32", "cpu", False),
])
def test_layerwise_fast_and_exact_agree(tiny_specs, optim, precision, device, checkpointing):
    spec = tiny_specs["llama"]
    settings = TrainSettings(batch_size=2, seq_len=32, device=device, optim=optim, precision=precision,
                             gradient_checkpointing=checkpointing, optim_args="rank=16",
                             optim_target_modules=("all-linear",)).validate(spec)
    fast, exact = fast_step_memory(spec, settings), exact_candidates(spec, settings)
    assert abs(fast.peak_bytes - exact.peak_bytes) <= 0.02 * exact.peak_bytes
    # the same step without layerwise holds every gradient after backward
    whole = fast_step_memory(spec, settings.replace(optim=optim.removesuffix("_layerwise")))
    assert whole.candidates["1.0|opt"]["gradients"] > 0 == fast.candidates["1.0|opt"]["gradients"]


def test_layerwise_refuses_accumulation_and_ddp_like_the_trainer(tiny_specs, tmp_path):
    from transformers import AutoConfig, AutoModelForCausalLM, Trainer, TrainingArguments

    from tests.conftest import TINY_LLAMA

    # the Trainer's own refusal, verified
    args = TrainingArguments(output_dir=str(tmp_path), optim="galore_adamw_layerwise", optim_target_modules="all-linear",
                             gradient_accumulation_steps=2, use_cpu=True, report_to=[])
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**TINY_LLAMA))
    with pytest.raises(ValueError, match="does not support gradient accumulation"):
        Trainer.get_optimizer_cls_and_kwargs(args, model)
    spec = tiny_specs["llama"]
    base = dict(optim="galore_adamw_layerwise", optim_target_modules=("all-linear",))
    with pytest.raises(MemFitError, match=r"^`--optim galore_adamw_layerwise` steps inside backward .* "
                                          r"`--gradient-accumulation-steps 1`$"):
        TrainSettings(gradient_accumulation_steps=2, **base).validate(spec)
    with pytest.raises(MemFitError, match=r"^`--optim galore_adamw_layerwise` does not support DDP"):
        TrainSettings(num_gpus=2, **base).validate(spec)


def test_planner_picks_layerwise_only_at_accumulation_1_on_one_gpu():
    allow = dict(allow_offload="none", allow_optimizers="galore_adamw_layerwise,apollo_adamw_layerwise")
    # Llama-2-7B on 50 GiB: only a layerwise optimizer fits (its gradients are never all held)
    chosen = plan("meta-llama/Llama-2-7b-hf", gpu_memory="50GiB", seq_len=1024, global_batch_size=2, **allow)
    assert chosen.plan.optim.endswith("_layerwise") and chosen.plan.gradient_accumulation_steps == 1
    assert chosen.estimate.breakdown["gradients"] == 0
    assert any("layerwise: each parameter is stepped" in r for r in chosen.plan.reasons)
    # a global batch that only fits as micro-batches with accumulation, or two GPUs: never layerwise
    for extra in (dict(global_batch_size=16), dict(global_batch_size=2, num_gpus=2)):
        with pytest.raises(MemFitError) as refused:
            plan("meta-llama/Llama-2-7b-hf", gpu_memory="50GiB", seq_len=1024, **{**allow, **extra})
        assert "layerwise" not in str(refused.value).split("what would fit")[0]


@pytest.mark.parametrize("optim, optim_args", [
    ("adamw_torch", None), ("adamw_torch_fused", None),
    ("adamw_torch_8bit", None), ("adamw_torch_4bit", None),
    ("adamw_torch_4bit", "bf16_stochastic_round=True"),
    ("adamw_torch_8bit", "block_size=128, bf16_stochastic_round=no"),
])
def test_adamw_without_the_trainer_table_is_the_trainer_s(optim, optim_args):
    """PyTorch's AdamW and torchao's low-bit AdamW are built without importing the Trainer's optimizer table (its
    module imports peft and bitsandbytes: a second of each process that traces them); class and kwargs must be
    exactly what `Trainer.get_optimizer_cls_and_kwargs` gives, `optim_args` included."""
    from hf_memfit.estimator.step import needs_trainer_table, trainer_optimizer_class

    settings = TrainSettings(batch_size=1, seq_len=8, optim=optim, optim_args=optim_args)
    assert not needs_trainer_table(settings)
    assert trainer_optimizer_class(settings) == _the_trainer_s(optim, optim_args)
    # what only the table knows: other arguments, other optimizers
    assert needs_trainer_table(settings.replace(optim_args="foo=1")) and needs_trainer_table(
        settings.replace(optim="adamw_bnb_8bit"))


@pytest.mark.parametrize("optim", ["adamw_bnb_8bit", "adamw_8bit", "paged_adamw_8bit", "paged_adamw_32bit",
                                   "adamw_torch_8bit", "adamw_torch_4bit", "adafactor", "sgd"])
def test_the_optimizer_table_read_from_its_own_module_is_the_trainer_s(optim):
    """The table is read from `transformers.trainer_optimizer`, without `transformers.trainer`'s other imports: the
    class and kwargs are what `Trainer.get_optimizer_cls_and_kwargs` gives, with and without `optim_args` (torchao's
    low-bit AdamW with an argument only the table knows, `foo`)."""
    from hf_memfit.estimator.step import OPTIMIZER_TABLE_MODULE, trainer_optimizer_class

    assert OPTIMIZER_TABLE_MODULE == "transformers.trainer_optimizer"  # transformers 5, as installed by .ci/run
    for optim_args in (None, "bf16_stochastic_round=True,foo=1" if optim.startswith("adamw_torch_") else None):
        settings = TrainSettings(batch_size=1, seq_len=8, optim=optim, optim_args=optim_args)
        assert trainer_optimizer_class(settings) == _the_trainer_s(optim, optim_args)


def _the_trainer_s(optim: str, optim_args: str | None):
    """The class and kwargs `Trainer.get_optimizer_cls_and_kwargs` gives for `optim` (no model)."""
    import tempfile

    from transformers import Trainer, TrainingArguments

    with tempfile.TemporaryDirectory() as tmp:
        return Trainer.get_optimizer_cls_and_kwargs(TrainingArguments(output_dir=tmp, optim=optim,
                                                                      optim_args=optim_args, report_to=[]))
