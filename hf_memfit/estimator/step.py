"""One training step as the HF Trainer runs it, on real or fake tensors.

The exact estimator (`trace.py`) runs these functions under `FakeTensorMode`,
and the accuracy benchmark runs the very same functions on real CPU tensors
under the profiler. Sharing them is what makes "exact" mean something: the
trace and the ground truth execute one code path.

What the HF Trainer (transformers 5.x, through accelerate) does per step:
- forward under `torch.autocast` for bf16/fp16 mixed precision, and
  accelerate's `convert_to_fp32` on the outputs (a transient fp32 logits copy);
- the loss from the model's own `labels` path, divided by the accumulation steps;
- backward; after the last micro-batch, `clip_grad_norm_(max_grad_norm=1.0)`,
  `optimizer.step()` and `model.zero_grad()` (set_to_none).

TRL's trainers (`settings.trainer` "sft" / "dpo", TRL 1.16) differ in the loss:
`__init__` patches the model with TRL's own fused LM head (`add_fused_lm_head`,
trl/trainer/utils.py, used here as is), which projects through the head in
chunks and returns per-token log-probs, entropy and top-1 hits instead of the
logits; `compute_loss` sums them (SFT's NLL; DPO's sigmoid loss over the
chosen and rejected rows, run as one batch, against a reference forward
without grad). The whole `compute_loss` runs under the Trainer's autocast.
"""

import contextlib
import functools
import importlib.metadata
import importlib.util
import tempfile

import torch

from hf_memfit.models.build import bnb_packed_modules, instantiate
from hf_memfit.estimator.int8_matmul import like_linear8bit
from hf_memfit.estimator.step_levers import (TrlOffloadedActivations, liger_causal_lm_forward,
                                             liger_in_place_accumulation, offload_checkpoint_inputs, tile_mlps)
from hf_memfit.errors import MemFitError
from hf_memfit.optimizers import parse_optim_args
from hf_memfit.settings import TrainSettings
from hf_memfit.tasks import TASK_TABLE

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def torch_dtype(name: str) -> torch.dtype:
    return _DTYPES[name]


@contextlib.contextmanager
def _swap_tensors_falls_back_to_set_data():
    """Let `Module.to()` work on fake tensors.

    `Module._apply` swaps parameters when they are FakeTensors, and the swap
    fails under a dispatch mode ("Couldn't swap Linear.weight"). peft moves its
    adapters with `.to()`, so we fall back to `param.data = new`, which is what
    `_apply` does for ordinary tensors.
    """
    original = torch.utils.swap_tensors

    def swap(t1, t2):
        try:
            original(t1, t2)
        except RuntimeError:
            t1.data = t2

    torch.utils.swap_tensors = swap
    try:
        yield
    finally:
        torch.utils.swap_tensors = original


def build_model(config: dict, settings: TrainSettings):
    """The transformers model (plus peft adapters) for `settings`, built from a config dict.

    Weights are created in their storage dtype directly (no `.to()`), with
    transformers' defaults for dropout and initialisation. For 4-bit QLoRA the
    base stays in the compute dtype here; `trace.py` accounts for the packed
    4-bit storage (bitsandbytes cannot run on fake tensors).
    """
    with quiet_transformers():  # building from a config warns about what it initialises
        return _build_model(config, settings)


@contextlib.contextmanager
def quiet_transformers():
    """transformers' warnings off while hf-memfit builds and runs its own model, and back on after.

    Not for the whole process: a trainer plans inside the user's run, whose logging is theirs. Deprecation
    warnings too: libraries call transformers' deprecated names on our model (peft reads
    `is_gradient_checkpointing` when it wraps one), which a plan's output should not show.
    """
    import warnings

    import transformers

    verbosity = transformers.logging.get_verbosity()
    transformers.logging.set_verbosity_error()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)
            warnings.simplefilter("ignore", DeprecationWarning)
            yield
    finally:
        transformers.logging.set_verbosity(verbosity)


def _build_model(config: dict, settings: TrainSettings):
    attn = settings.attn_implementation
    if attn == "flash_attention_2":
        attn = "sdpa"  # the flash kernel's memory is modelled on the sdpa path (trace.py)
    weights_dtype = settings.weights_dtype
    if settings.load_in_kbit and weights_dtype == "float32":
        weights_dtype = settings.compute_dtype
    model = instantiate(config, settings.task, settings.num_labels, dtype=torch_dtype(weights_dtype),
                        attn_implementation=attn)
    if settings.gradient_checkpointing:
        if hasattr(model, "activation_checkpointing_enable"):  # transformers >= 5.x; the old name warns
            model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
        else:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        if settings.offload_activations:
            offload_checkpoint_inputs(model)
    if settings.use_liger_kernel:
        model.forward = liger_causal_lm_forward(model, liger_in_place_accumulation(settings))
    if settings.tiled_mlp:
        tile_mlps(model, model.config.get_text_config().hidden_size)
    if settings.trainer != "trainer":
        _add_trl_head(model, settings.trainer)
    if settings.frozen:
        freeze(model, settings.frozen)
    packed = quantizable_linears(model) if settings.load_in_kbit else None  # by module names: before the adapters
    if settings.kbit_prepared:
        prepare_like_peft_kbit_training(model, settings, packed)
    if settings.load_in_8bit:
        for module in packed:
            like_linear8bit(module, cuda=settings.device == "cuda")
    if settings.uses_lora:
        model = _add_lora(model, settings)
    if packed is not None:
        model.__dict__["memfit_packed_4bit"] = packed  # not an attribute: `Module.__getattr__` and peft see nothing
    if settings.activation_offloading:
        # SFTTrainer / DPOTrainer build it on `self.model` (the peft model) after `Trainer.__init__`
        model.__dict__["memfit_trl_offload"] = TrlOffloadedActivations(model)
        model.memfit_host_stash = model.__dict__["memfit_trl_offload"].host
    model.train()
    if settings.reference == "copy":
        # DPOTrainer keeps a frozen copy of the model (same dtype, no adapters), patched with the default head.
        reference = instantiate(config, settings.task, settings.num_labels, dtype=torch_dtype(weights_dtype),
                                attn_implementation=attn)
        reference.requires_grad_(False)
        reference.eval()
        _add_trl_head(reference, "reference")
        model.__dict__["memfit_reference"] = reference  # not a submodule: no gradients, not in the optimizer
    return model


# The per-token outputs each TRL trainer asks its fused LM head for (TRL 1.16: sft_trainer.py and
# dpo_trainer.py `add_fused_lm_head(..., outputs=...)`; DPO's reference model keeps the default).
TRL_HEAD_OUTPUTS = {"sft": ("log_probs", "entropy", "is_top1"),
                    "dpo": ("log_probs", "entropy", "mean_logits", "is_top1"),
                    "reference": ("log_probs",)}


def _add_trl_head(model, trainer: str) -> None:
    from trl.trainer.utils import add_fused_lm_head

    add_fused_lm_head(model, outputs=TRL_HEAD_OUTPUTS[trainer])


def reference_model(model):
    """DPO's separate reference model built beside `model`, or None."""
    return model.__dict__.get("memfit_reference")


def freeze(model, names) -> None:
    """Freeze the named modules, as `freeze_feature_encoder()` or `model.vision_tower.requires_grad_(False)` do."""
    from hf_memfit.errors import CannotEstimate, MemFitError

    modules = dict(model.named_modules())
    missing = [name for name in names if name not in modules]
    if any(part.isdigit() for name in missing for part in name.split(".")):
        # A layer past the 2-3 a stack is traced with (`models/depths.py`): the extrapolation adds trained
        # layers, so freezing some layers of a stack is not something it can model.
        raise CannotEstimate(f"`--freeze` {', '.join(missing)}: freezing single layers of a stack is not modelled "
                             "(each stack is traced at 2-3 layers and extrapolated); freeze whole modules, such as "
                             "a tower or a feature encoder")
    if missing:
        raise MemFitError(f"`--freeze` {', '.join(missing)}: no such module in the model; name modules as "
                          "model.named_modules() does (e.g. wav2vec2.feature_extractor, model.vision_tower)")
    for name in names:
        if hasattr(modules[name], "_freeze_parameters"):  # wav2vec2's feature encoder: no input gradient either
            modules[name]._freeze_parameters()
        else:
            modules[name].requires_grad_(False)


def quantizable_linears(model) -> list:
    """The layers bitsandbytes packs to 4 bits (`models.build.bnb_packed_modules`: transformers' own rule); every
    other parameter stays unpacked. Here they are built in the compute dtype and packed by formula afterwards
    (`sharding._pack_4bit`); on a peft-wrapped model the list `build_model` made before adding adapters is read
    back."""
    known = model.__dict__.get("memfit_packed_4bit")
    if known is not None:
        return known
    return [module for _, module in bnb_packed_modules(model)]


def prepare_like_peft_kbit_training(model, settings: TrainSettings, packed: list | None = None) -> None:
    """What peft's `prepare_model_for_kbit_training` does to memory, on a model whose 4-bit layers stand in bf16.

    peft (utils/other.py) freezes the model and casts every fp16/bf16 parameter that is not a bitsandbytes
    `Params4bit` to fp32 ("cast all non INT8 parameters to fp32"): the embeddings, the LM head, the norms.
    The stand-ins for the packed layers keep their dtype, and run as bitsandbytes' `Linear4bit.forward`
    does (bitsandbytes nn/modules.py): the input cast to the compute dtype, and the output cast back to the
    input's dtype, which the fp32 residual stream now makes fp32. (Without the preparation the input is
    already in the compute dtype and both casts are no-ops, so the stand-ins run as plain Linear layers.)
    peft's gradient-checkpointing side (`enable_input_require_grads` for reentrant checkpoints) is left to
    `gradient_checkpointing`, which hf-memfit runs non-reentrant.
    """
    if any(type(p).__name__ in ("Params4bit", "Int8Params") for p in model.parameters()):
        from peft import prepare_model_for_kbit_training  # a real 4-bit model (`hf-memfit check` on CUDA): peft's own

        prepare_model_for_kbit_training(model, use_gradient_checkpointing=False)  # checkpointing is build_model's
        return
    compute = torch_dtype(settings.compute_dtype)
    packed = quantizable_linears(model) if packed is None else packed
    # bitsandbytes casts a packed layer's bias to the compute dtype on its first forward
    # (an int8 layer's bias is a plain Parameter, which peft upcasts: estimator/int8.py)
    kept = {id(p) for module in packed for p in (module.weight, module.bias)
            if p is not None and (settings.load_in_4bit or p is module.weight)}
    for param in model.parameters():
        param.requires_grad_(False)
        if param.dtype in (torch.float16, torch.bfloat16) and id(param) not in kept:
            param.data = param.data.to(torch.float32)
    for module in packed if settings.load_in_4bit else ():  # int8 layers: `int8.like_linear8bit`
        module.forward = _like_linear4bit(module, compute)


def _like_linear4bit(module, compute_dtype):
    plain = module.forward

    def forward(x):
        return plain(x.to(compute_dtype)).to(x.dtype)

    return forward


def _add_lora(model, settings: TrainSettings):
    from peft import LoraConfig, get_peft_model

    kwargs = {"r": settings.lora_r or 8, "task_type": TASK_TABLE[settings.task].peft_task_type}  # peft's default r is 8
    if settings.lora_alpha is not None:
        kwargs["lora_alpha"] = settings.lora_alpha
    if settings.lora_target_modules is not None:
        targets = list(settings.lora_target_modules)
        # peft takes the string "all-linear" (every linear layer but the output one), not a list holding it.
        kwargs["target_modules"] = "all-linear" if targets == ["all-linear"] else targets
    if settings.lora_target_regex is not None:
        kwargs["target_modules"] = settings.lora_target_regex  # a string: peft full-matches it as a regex
    if settings.load_in_kbit:
        for param in model.parameters():
            param.requires_grad_(False)
    with _swap_tensors_falls_back_to_set_data():
        try:
            return get_peft_model(model, LoraConfig(**kwargs))
        except ValueError as exc:
            if settings.lora_target_regex is None or "not found" not in str(exc):
                raise
            from hf_memfit.errors import MemFitError

            raise MemFitError(f"`--lora-target-regex {settings.lora_target_regex}` matches no module of the model "
                              "(peft full-matches it against names such as model.layers.0.self_attn.q_proj; a "
                              "pattern that names layers by index is not modelled: each stack is traced at 2-3 "
                              "layers)") from None


def make_batch(settings: TrainSettings, config: dict, device: str = "cpu") -> dict:
    """A batch of the settings' shape: labels = input ids (LM tasks) or class ids (classification).

    TRL batches are what its collators make: DPO stacks the chosen rows over the
    rejected ones, with an attention mask (their lengths differ, so there is
    padding) and a completion mask; padding-free packs every sequence into one
    row whose position ids restart at each sequence. Seq2seq labels have the
    decoder's length.
    """
    from hf_memfit.models.inputs import make_inputs, uses_inputs

    if uses_inputs(settings):
        return make_inputs(config, settings, device)  # images, audio, choices, answer spans
    text = config.get("text_config") if isinstance(config.get("text_config"), dict) else {}
    vocab = config.get("vocab_size") or text.get("vocab_size") or 1000
    shape = (settings.rows, settings.row_len)
    input_ids = torch.randint(0, vocab, shape, device=device)
    if settings.task == "seq-cls":
        labels = torch.randint(0, settings.num_labels, (settings.batch_size,), device=device)
    elif settings.task == "token-cls":
        labels = torch.randint(0, settings.num_labels, shape, device=device)
    elif settings.task == "seq2seq" and settings.decoder_seq_len is not None:
        labels = torch.randint(0, vocab, (settings.rows, settings.decoder_seq_len), device=device)
    else:
        labels = input_ids.clone()
    if settings.trainer == "dpo":
        ones = torch.ones(shape, dtype=torch.long, device=device)
        return {"input_ids": input_ids, "attention_mask": ones, "completion_mask": ones.clone()}
    batch = {"input_ids": input_ids, "labels": labels}
    if settings.padding_free:
        batch["position_ids"] = torch.arange(settings.seq_len, device=device).repeat(1, settings.row_len // settings.seq_len)
    return batch


# PyTorch's AdamW as the Trainer's table gives it (transformers 5.24 trainer_optimizer.py `_get_adamw_torch`:
# TrainingArguments' lr, betas and eps, plus `fused=True` for adamw_torch_fused), without importing the table:
# the table's module imports peft, bitsandbytes and torchao on its way, seconds of a cold plan whose optimizer
# is neither. tests/test_optimizers.py holds these against `Trainer.get_optimizer_cls_and_kwargs`.
TORCH_ADAMW_DEFAULTS = {"lr": 5e-05, "betas": (0.9, 0.999), "eps": 1e-08}
TORCH_ADAMW = {"adamw_torch": {}, "adamw_torch_fused": {"fused": True}}
# torchao's low-bit AdamW likewise (5.24 `_get_torchao_optimizer`): lr, then `block_size` (256, or the `optim_args`
# string as given) and `bf16_stochastic_round` (its `strtobool`), then betas and eps. The pure-bf16 plans and the
# plans near a budget take these; the table's module cost each process of their exact confirmation 0.9 s.
TORCHAO_ADAMW = {"adamw_torch_8bit": "AdamW8bit", "adamw_torch_4bit": "AdamW4bit"}
TORCHAO_OPTIM_ARGS = {"block_size", "bf16_stochastic_round"}


def needs_trainer_table(settings: TrainSettings) -> bool:
    """Whether the optimizer comes from the Trainer's table (`trainer_optimizer_class`) rather than the above."""
    if settings.optim in TORCHAO_ADAMW and _torchao_optim():
        given = parse_optim_args(settings.optim_args)
        return given is None or not set(given) <= TORCHAO_OPTIM_ARGS
    return settings.optim not in TORCH_ADAMW or bool(settings.optim_args)


@functools.cache
def _torchao_optim() -> bool:
    """Whether torchao is installed with `torchao.optim`, where the table takes its AdamW from (0.11 and later)."""
    if importlib.util.find_spec("torchao") is None:
        return False
    from packaging.version import Version

    return Version(importlib.metadata.version("torchao")) >= Version("0.11.0")


def heavy_step_imports(settings: TrainSettings) -> list[str]:
    """The modules a step of `settings` imports on its way that cost seconds, or make tensors when imported
    (bitsandbytes' 4-bit code tables, peft's LoHa default scale): imported ahead of a trace, outside its
    tracker, and in a parent before it forks traces."""
    return [name for name, wanted in (
        (OPTIMIZER_TABLE_MODULE, needs_trainer_table(settings)),  # the optimizer table: peft, bitsandbytes, torchao
        ("trl.trainer.utils", settings.trainer != "trainer"),  # TRL's fused head (`_add_trl_head`): peft, bitsandbytes
        ("peft", settings.uses_lora),
        ("bitsandbytes", settings.load_in_kbit or settings.optimizer.package == "bitsandbytes")) if wanted]


def import_step_modules(config: dict, settings: TrainSettings) -> None:
    """Import what a step imports on its way (`heavy_step_imports` and the model family's module) before a trace's
    tracker starts. Some modules make tensors when imported (bitsandbytes' 4-bit code tables, peft's LoHa default
    scale: 144 B, kept for the life of the process); made inside a trace, they would be counted as weights in the
    first trace of a process only."""
    import importlib

    names = heavy_step_imports(settings)
    if config.get("model_type"):
        from transformers.models.auto.configuration_auto import model_type_to_module_name

        names.append("transformers.models.{0}.modeling_{0}".format(model_type_to_module_name(config["model_type"])))
    for name in names:
        try:
            importlib.import_module(name)
        except ImportError:  # the step that needs it reports it
            pass


def trainer_optimizer_class(settings: TrainSettings, model=None):
    """The optimizer class and kwargs the HF Trainer builds for `settings.optim` (`Trainer.get_optimizer_cls_and_kwargs`).

    GaLore / APOLLO need the model: their kwargs then carry `params`, the Trainer's
    own groups (projected targets and the rest).
    """
    if not needs_trainer_table(settings):
        if settings.optim in TORCH_ADAMW:
            return torch.optim.AdamW, dict(TORCH_ADAMW_DEFAULTS, **TORCH_ADAMW[settings.optim])
        import torchao.optim
        from transformers.utils import strtobool

        given = parse_optim_args(settings.optim_args)
        return getattr(torchao.optim, TORCHAO_ADAMW[settings.optim]), {
            "lr": TORCH_ADAMW_DEFAULTS["lr"], "block_size": given.get("block_size", 256),
            "bf16_stochastic_round": strtobool(given.get("bf16_stochastic_round", "False")),
            "betas": TORCH_ADAMW_DEFAULTS["betas"], "eps": TORCH_ADAMW_DEFAULTS["eps"]}
    from transformers import TrainingArguments

    targets = settings.optim_target_modules
    if targets == ("all-linear",):
        targets = "all-linear"
    with tempfile.TemporaryDirectory() as tmp:
        args = TrainingArguments(output_dir=tmp, optim=settings.optim, optim_args=settings.optim_args,
                                 optim_target_modules=list(targets) if isinstance(targets, tuple) else targets,
                                 gradient_accumulation_steps=settings.gradient_accumulation_steps, report_to=[])
        return _get_optimizer_cls_and_kwargs(args, model)


# transformers 5 keeps the Trainer's optimizer table in its own module, and `Trainer.get_optimizer_cls_and_kwargs`
# only wraps the arguments for it (5.24 trainer.py): read from there, a trace skips `transformers.trainer`'s other
# imports (datasets among them: 0.5 s of its 1.4 s here, paid by each process of a plan that takes bitsandbytes'
# 8-bit AdamW). tests/test_optimizers.py holds the two to the same class and kwargs. Older releases: the Trainer's.
OPTIMIZER_TABLE_MODULE = ("transformers.trainer_optimizer" if importlib.util.find_spec("transformers.trainer_optimizer")
                          else "transformers.trainer")


def _get_optimizer_cls_and_kwargs(args, model):
    """`Trainer.get_optimizer_cls_and_kwargs(args, model)`, from the table's own module where there is one."""
    if OPTIMIZER_TABLE_MODULE == "transformers.trainer":
        from transformers import Trainer

        return Trainer.get_optimizer_cls_and_kwargs(args, model)
    from transformers.trainer_optimizer import _OPTIMIZER_HANDLERS, OptimizerContext, _parse_optim_args

    context = OptimizerContext(args=args, model=model, optimizer_kwargs={"lr": args.learning_rate},
                               adam_kwargs={"betas": (args.adam_beta1, args.adam_beta2), "eps": args.adam_epsilon},
                               optim_args=_parse_optim_args(args.optim_args))
    handler = _OPTIMIZER_HANDLERS.get(args.optim)
    if handler is None:
        raise ValueError(f"Trainer cannot instantiate unsupported optimizer: {args.optim}")
    return handler(context)


def param_groups(model) -> list[dict]:
    """The Trainer's two groups: weight decay on weights, none on biases and norms."""
    from transformers.trainer_pt_utils import get_parameter_names

    try:
        from transformers.pytorch_utils import ALL_LAYERNORM_LAYERS as norm_layers
    except ImportError:  # transformers moved it; norms are matched by name below too
        norm_layers = [torch.nn.LayerNorm]
    decay = set(get_parameter_names(model, norm_layers, ["bias", "layernorm", "rmsnorm", "norm"]))
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    return [
        {"params": [p for n, p in named if n in decay], "weight_decay": 0.0},
        {"params": [p for n, p in named if n not in decay], "weight_decay": 0.0},
    ]


def make_optimizer(model, settings: TrainSettings, *, cuda_semantics: bool = False):
    """The real optimizer class the Trainer would use, over the Trainer's param groups.

    With `cuda_semantics`, torch's AdamW takes the foreach path that torch picks
    by default on CUDA (`_default_to_fused_or_foreach`); on CPU tensors torch
    would otherwise pick the single-tensor loop, which keeps no temporaries.
    """
    optimizer_cls, kwargs = trainer_optimizer_class(settings, model)
    kwargs = dict(kwargs)
    groups = kwargs.pop("params", None) or [g for g in param_groups(model) if g["params"]]
    if "optimizer_dict" in kwargs:
        # Layerwise GaLore / APOLLO: `get_optimizer_cls_and_kwargs` has already made one optimizer per
        # parameter and registered the post-accumulate-grad hooks that step them inside backward; the
        # Trainer then builds `LayerWiseDummyOptimizer(optimizer_dict, ...)`, whose step does nothing.
        return optimizer_cls(kwargs.pop("optimizer_dict"), **kwargs)
    if cuda_semantics and optimizer_cls in (torch.optim.AdamW, torch.optim.Adam) and not kwargs.get("fused"):
        kwargs = {**kwargs, "foreach": True}
    optimizer = optimizer_cls(groups, **kwargs)
    if any(cls.__module__.startswith("bitsandbytes") for cls in optimizer_cls.__mro__):
        _bnb_overrides_as_the_trainer_sets_them(model, trainer_keeps_embeddings_32bit(optimizer_cls, kwargs))
    return optimizer


def trainer_keeps_embeddings_32bit(optimizer_cls, kwargs: dict) -> bool:
    """Whether the Trainer gives `nn.Embedding` weights 32-bit states: its bitsandbytes 8-bit optimizers.

    `Trainer.create_optimizer` (transformers 5.23): for a bitsandbytes class with
    `optim_bits == 8` it registers `{"optim_bits": 32}` for every `nn.Embedding`
    weight with bitsandbytes' `GlobalOptimManager`, which the optimizer applies at
    its first step (`check_overrides`). A frozen embedding is in no param group, so
    nothing changes for it.
    """
    return "bitsandbytes" in str(optimizer_cls) and kwargs.get("optim_bits") == 8


def _bnb_overrides_as_the_trainer_sets_them(model, embeddings_32bit: bool) -> None:
    """bitsandbytes' per-parameter overrides for this optimizer: 32-bit embeddings where the Trainer asks.

    bitsandbytes keeps overrides in a process-wide singleton (`GlobalOptimManager`), looked up by
    (group, position) and by `id(param)`, so what an earlier optimizer in this process registered
    would apply to this one's parameters: start from a clean manager. The Trainer registers the
    module (`register_module_override`), which keeps the module alive in the singleton; the same
    override by parameter id (`override_config`) holds no reference, so a measured model is freed
    when the measurement drops it.
    """
    import bitsandbytes

    manager = bitsandbytes.optim.GlobalOptimManager.get_instance()
    manager.initialize()
    if embeddings_32bit:
        for module in model.modules():
            if isinstance(module, torch.nn.Embedding):
                manager.override_config(module.weight, key_value_dict={"optim_bits": 32})


def forward_backward(model, batch: dict, settings: TrainSettings, device_type: str = "cpu"):
    """Forward (with autocast as the precision asks), loss, backward: one micro-batch."""
    from accelerate.utils import convert_to_fp32

    if settings.trainer != "trainer":
        return _trl_forward_backward(model, batch, settings, device_type)
    autocast_dtype = settings.autocast_dtype
    if autocast_dtype:
        with torch.autocast(device_type, dtype=torch_dtype(autocast_dtype)):
            outputs = model(**batch)
        outputs = convert_to_fp32(outputs)  # accelerate wraps forward with this under native AMP
    else:
        outputs = model(**batch)
    loss = outputs["loss"]
    del outputs
    if settings.gradient_accumulation_steps > 1:
        loss = loss / settings.gradient_accumulation_steps
    if settings.precision == "fp16-mixed":
        loss = loss * 65536.0  # GradScaler's initial scale; the unscale is in place
    loss.backward()
    return loss.detach()


def _trl_forward_backward(model, batch: dict, settings: TrainSettings, device_type: str):
    """TRL 1.16's `compute_loss` (SFTTrainer's, or DPOTrainer's `_compute_loss` with its defaults), then backward."""
    offload = model.__dict__.get("memfit_trl_offload")
    with offload if offload is not None else contextlib.nullcontext():  # TRL wraps the whole training_step
        return _trl_loss_backward(model, batch, settings, device_type)


def _trl_loss_backward(model, batch: dict, settings: TrainSettings, device_type: str):
    autocast_dtype = settings.autocast_dtype
    autocast = torch.autocast(device_type, dtype=torch_dtype(autocast_dtype)) if autocast_dtype else \
        contextlib.nullcontext()
    with autocast:
        if settings.trainer == "sft":
            outputs = model(**batch, use_cache=False, fused_lm_head=True)
            loss = -outputs.log_probs.sum() / outputs.label_mask.sum().clamp(min=1)
            metrics = (outputs.label_mask.sum(), outputs.entropy.detach().sum(), outputs.is_top1.sum())
        else:
            completion_mask = batch["completion_mask"]
            inputs = {k: v for k, v in batch.items() if k != "completion_mask"}
            labels = batch["input_ids"].masked_fill(completion_mask == 0, -100)
            seq_len = completion_mask.size(1) - 1
            outputs = model(**inputs, labels=labels, use_cache=False, fused_lm_head=True)
            chosen, rejected = outputs.log_probs[:, -seq_len:].sum(dim=1).chunk(2, dim=0)
            if settings.reference == "precomputed":
                ref_chosen, ref_rejected = (torch.zeros_like(chosen), torch.zeros_like(rejected))  # from the dataset
            else:
                with torch.no_grad():
                    if settings.reference == "adapters":
                        with model.disable_adapter():
                            ref = model(**inputs, labels=labels, use_cache=False, fused_lm_head=True)
                    else:
                        ref = reference_model(model)(**inputs, labels=labels, use_cache=False, fused_lm_head=True)
                ref_chosen, ref_rejected = ref.log_probs[:, -seq_len:].sum(dim=1).chunk(2, dim=0)
                del ref
            beta = 0.1  # DPOConfig's default; the value does not change the memory
            loss = -torch.nn.functional.logsigmoid(beta * ((chosen - ref_chosen) - (rejected - ref_rejected))).mean()
            metrics = (outputs.label_mask.sum(), outputs.entropy.detach().sum(), outputs.is_top1.sum(),
                       outputs.mean_logits.sum())
    del outputs, metrics
    if settings.gradient_accumulation_steps > 1:
        loss = loss / settings.gradient_accumulation_steps
    if settings.precision == "fp16-mixed":
        loss = loss * 65536.0
    loss.backward()
    return loss.detach()


def inner_optimizers(optimizer) -> list:
    """The optimizers that really step: the per-parameter ones behind a layerwise dummy, else `optimizer` itself."""
    per_parameter = getattr(optimizer, "optimizer_dict", None)
    return list(per_parameter.values()) if per_parameter else [optimizer]


@contextlib.contextmanager
def cuda_synchronize_without_cuda():
    """Let `torch.cuda.synchronize()` return at once on a torch built without CUDA.

    galore_torch's `GaLoreAdamW8bit.step` calls it after every parameter's update
    (galore_torch/adamw8bit.py), which a CPU-only torch refuses ("Torch not compiled
    with CUDA enabled"). A synchronisation allocates nothing, so on a CPU build it
    can only be a no-op; with CUDA present nothing is changed.
    """
    if torch.cuda.is_available():
        yield
        return
    original = torch.cuda.synchronize
    torch.cuda.synchronize = lambda device=None: None
    try:
        yield
    finally:
        torch.cuda.synchronize = original


@contextlib.contextmanager
def optim_args_named(settings: TrainSettings):
    """An optimizer whose step fails on the `optim_args` it was given, as one line naming them: the Trainer passes
    their values as strings (`--optim-args block_size=128` reaches torchao's AdamW as '128'), and its run would fail
    at the same step."""
    try:
        yield
    except (TypeError, ValueError) as error:
        if not settings.optim_args:
            raise
        raise MemFitError(f"`--optim {settings.optim} --optim-args {settings.optim_args!r}`: the optimizer the Trainer "
                          f"builds from them fails at its step ({type(error).__name__}: {error}); the Trainer's run "
                          "would fail there too") from error


def optimizer_step(model, optimizer, *, cuda_semantics: bool = False) -> None:
    """Clip (Trainer default max_grad_norm=1.0), step, and zero the grads to None."""
    params = [p for p in model.parameters() if p.grad is not None]
    torch.nn.utils.clip_grad_norm_(params, 1.0, foreach=True if cuda_semantics else None)
    optimizer.step()
    model.zero_grad(set_to_none=True)
