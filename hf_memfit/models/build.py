"""Build the transformers model for a config dict and a task: what exact mode traces, the CPU measurement runs
and `hf-memfit check` trains, one code path for all three."""

from __future__ import annotations

import contextlib
import copy

from hf_memfit.cache import library_version
from hf_memfit.errors import CannotEstimate
from hf_memfit.tasks import TASK_TABLE


def hf_config(config: dict, name: str = ""):
    """The transformers config object for a config dict; a one-line `MemFitError` when it cannot be built."""
    import transformers

    transformers.logging.set_verbosity_error()
    model_type = config.get("model_type")
    version = library_version("transformers")
    try:
        # A copy: transformers' config classes write into the nested dicts they are given (Qwen2.5-VL's
        # `rope_scaling` gains `rope_theta` and `rope_type`), and the spec's config keys every cached fit and
        # trace: a spec described in this process hashed other than the same spec read back from the cache, so
        # a second cold-cache plan traced every fit again.
        given = copy.deepcopy(config)
        if model_type not in transformers.CONFIG_MAPPING:
            return transformers.AutoConfig.for_model(**given)  # its ValueError names the model types it knows
        config_class = transformers.CONFIG_MAPPING[model_type]
        derived = {key: given.pop(key) for key in derived_attributes(config_class) if isinstance(given.get(key), list)}
        if derived:
            config_class = _with_layer_lists(config_class, derived)
        given.pop("model_type")
        return config_class(**given)
    except (ValueError, KeyError) as exc:
        remote = " (its config names remote code in `auto_map`, which hf-memfit does not run)" \
            if "auto_map" in config else ""
        shown = f"`{name}` " if name else ""
        raise CannotEstimate(f"`model` {shown}has model_type `{model_type}`, which transformers {version} cannot "
                          f"build{remote}; upgrade transformers or pass a config of a model type it "
                          f"knows ({str(exc).split('. ')[0][:120]})") from None


def derived_attributes(config_class) -> list[str]:
    """The public read-only properties a model's config class adds: what it derives from its fields (Jamba's
    `layers_block_type`), which a config dict cannot set. Not the base class's (`use_return_dict`, ...)."""
    from transformers import PretrainedConfig

    base = set(dir(PretrainedConfig))
    return [name for name in dir(config_class) if not name.startswith("_") and name not in base
            and isinstance(getattr(config_class, name), property) and getattr(config_class, name).fset is None]


def _with_layer_lists(config_class, lists: dict[str, list]):
    """`config_class` with the per-layer lists it derives from a pattern (Jamba's `layers_block_type` and
    `layers_num_experts`: attention every 8th layer from 4, experts every 2nd from 1) taken as given instead.
    A trace by kinds (`models/depths.py`) asks for an order no period and offset give: two layers of each kind.
    The subclass keeps the class's name, which is what transformers' auto classes look a model class up by."""
    overrides = {name: property(lambda self, values=tuple(values): list(values)) for name, values in lists.items()}
    return type(config_class.__name__, (config_class,), {**overrides, "__module__": config_class.__module__})


def auto_model_class(task: str):
    import transformers

    return getattr(transformers, TASK_TABLE[task].auto_class)


def instantiate(config: dict, task: str, num_labels: int, *, dtype, attn_implementation: str | None,
                meta: bool = False):
    """The task's transformers model from a config dict, built as `from_pretrained` builds it, in train mode.

    `from_pretrained` of a checkpoint with none of the model's weights (`state_dict={}`), which is transformers'
    own loading path with every key missing: the model is made on the meta device without tying, each untied
    parameter and non-persistent buffer is then given its memory one at a time (`_move_missing_keys_from_meta_to_
    device`), initialised in place (`initialize_weights`), and tied. A fine-tune loads its weights this way, so
    what it holds while the model is made is the weights. `from_config` makes every module with its own weights
    before tying them: T5's two `embed_tokens` beside `shared`, a tied `lm_head`. A tiny T5 with a 64,000-token
    vocabulary measured 3.6 times its weights while being made that way, and exact mode's peak for Gemma-2-2B LoRA
    was there (docs/benchmarks.md, known problem 2). The initialisation is transformers' `_init_weights`, as before.

    With `meta`, the model on the meta device, as `from_config` makes it (tied, no memory): `from_pretrained` refuses
    a meta device context.

    With no attention implementation asked for, SDPA where the model supports
    it and eager otherwise, which is what transformers itself picks. SDPA asked
    for (the planner's default) on a model without it is eager too: a model with
    no attention at all (Mamba) refuses every implementation but eager.
    """
    import torch
    from transformers.models.auto.auto_factory import _get_model_class

    built = hf_config(config)
    if task in ("seq-cls", "token-cls"):
        built.num_labels = num_labels
        if task == "seq-cls" and getattr(built, "pad_token_id", None) is None:
            # Sequence classification on decoder models needs a pad id to find the last token.
            text = built.get_text_config() if hasattr(built, "get_text_config") else built
            pad = getattr(built, "eos_token_id", None) or getattr(text, "eos_token_id", None) or 0
            built.pad_token_id = pad[0] if isinstance(pad, list) else pad
    if hasattr(built, "quantization_config"):
        # The config of a model loaded quantized (`MemFitTrainer` reads `model.config`) names its quantization;
        # `from_pretrained` would quantize by it, `from_config` never did. The settings say how the weights are
        # stored (`load_in_4bit`, `load_in_8bit`), and the trace and the measurement apply that themselves.
        del built.quantization_config
    model_class = _get_model_class(built, auto_model_class(task)._model_mapping)

    def build(attn: str):
        if meta:
            with torch.device("meta"):
                return model_class._from_config(built, dtype=dtype, attn_implementation=attn)  # `from_config`'s call
        with _no_progress_bar():  # a "Loading weights" bar of nothing loaded, in a plan's output
            model = model_class.from_pretrained(None, config=built, state_dict={}, dtype=dtype,
                                                attn_implementation=attn)
        return model.train()  # `from_pretrained` ends in eval mode; `from_config`, and a training run, in train mode

    try:
        return build(attn_implementation or "sdpa")
    except ValueError as exc:
        if attn_implementation not in (None, "sdpa") or "scaled_dot_product_attention" not in str(exc):
            raise
    return build("eager")  # no SDPA for this model


@contextlib.contextmanager
def _no_progress_bar():
    """transformers' progress bars off while open, and as they were after."""
    from transformers.utils import logging

    enabled = logging.is_progress_bar_enabled()
    logging.disable_progress_bar()
    try:
        yield
    finally:
        if enabled:
            logging.enable_progress_bar()


def bnb_packed_modules(model) -> list[tuple[str, object]]:
    """(name, module) of the layers bitsandbytes packs to 4 bits, by transformers' own rule.

    transformers 5.24 `replace_with_bnb_linear` (integrations/bitsandbytes.py) makes a `Linear4bit` of a module
    only when it is exactly an `nn.Linear` (`type(module) is nn.Linear`: subclasses such as Falcon's
    `FalconLinear` or Phi-MoE's router are left alone) or GPT-2's `Conv1D`, and its name is not in the
    quantizer's `modules_to_not_convert` (quantizer_bnb_4bit.py `_process_model_before_weight_loading`:
    `get_keys_to_not_convert`, i.e. tied weights, the last parameter's module and the output embedding, plus
    `_keep_in_fp32_modules`, e.g. T5's `wo`); `param_needs_quantization` then quantizes only `Linear4bit`
    weights. So the fused 3-D experts of transformers 5 MoE layers (`JambaExperts.gate_up_proj`,
    `Qwen3MoeExperts.down_proj`: `nn.Parameter`s, not modules) load unpacked in the checkpoint's dtype
    (tests/test_qlora.py loads tiny models through bitsandbytes). A classification head (`score`,
    `classifier`) is trained whole, and adapters are never packed.
    """
    import torch
    from transformers.pytorch_utils import Conv1D
    from transformers.quantizers.base import get_keys_to_not_convert
    from transformers.quantizers.quantizers_utils import should_convert_module

    skip = list(get_keys_to_not_convert(model)) + list(getattr(model, "_keep_in_fp32_modules", None) or ())
    return [(name, module) for name, module in model.named_modules()
            if (type(module) is torch.nn.Linear or isinstance(module, Conv1D)) and should_convert_module(name, skip)
            and not any(part in name for part in ("lora_", "score", "classifier"))]
