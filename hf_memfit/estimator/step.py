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
import tempfile
import weakref

import torch

from hf_memfit.models.generic import instantiate
from hf_memfit.settings import TrainSettings

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

    Not for the whole process: a trainer plans inside the user's run, whose logging is theirs.
    """
    import transformers

    verbosity = transformers.logging.get_verbosity()
    transformers.logging.set_verbosity_error()
    try:
        yield
    finally:
        transformers.logging.set_verbosity(verbosity)


def _build_model(config: dict, settings: TrainSettings):
    attn = settings.attn_implementation
    if attn == "flash_attention_2":
        attn = "sdpa"  # the flash kernel's memory is modelled on the sdpa path (trace.py)
    weights_dtype = settings.weights_dtype
    if settings.load_in_4bit and weights_dtype == "float32":
        weights_dtype = settings.compute_dtype
    model = instantiate(config, settings.task, settings.num_labels, dtype=torch_dtype(weights_dtype),
                        attn_implementation=attn)
    if settings.gradient_checkpointing:
        if hasattr(model, "activation_checkpointing_enable"):  # transformers >= 5.x; the old name warns
            model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
        else:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        if settings.offload_activations:
            _offload_checkpoint_inputs(model)
    if settings.use_liger_kernel:
        model.forward = _liger_causal_lm_forward(model, _liger_in_place_accumulation(settings))
    if settings.trainer != "trainer":
        _add_trl_head(model, settings.trainer)
    if settings.uses_lora:
        model = _add_lora(model, settings)
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


def _add_lora(model, settings: TrainSettings):
    from peft import LoraConfig, get_peft_model

    task_type = {"causal-lm": "CAUSAL_LM", "seq-cls": "SEQ_CLS", "seq2seq": "SEQ_2_SEQ_LM", "token-cls": "TOKEN_CLS",
                 "image-text-to-text": "CAUSAL_LM"}[settings.task]
    kwargs = {"r": settings.lora_r or 8, "task_type": task_type}  # peft's default r is 8
    if settings.lora_alpha is not None:
        kwargs["lora_alpha"] = settings.lora_alpha
    if settings.lora_target_modules is not None:
        targets = list(settings.lora_target_modules)
        # peft takes the string "all-linear" (every linear layer but the output one), not a list holding it.
        kwargs["target_modules"] = "all-linear" if targets == ["all-linear"] else targets
    if settings.load_in_4bit:
        for param in model.parameters():
            param.requires_grad_(False)
    with _swap_tensors_falls_back_to_set_data():
        return get_peft_model(model, LoraConfig(**kwargs))


# --- activation checkpoints offloaded to the host -------------------------------------------

class HostStash:
    """Pinned host memory held by offloaded checkpoint inputs: live bytes and their peak."""

    def __init__(self):
        self.live = self.peak = 0


def _offload_checkpoint_inputs(model) -> None:
    """transformers' `activation_checkpointing_enable(offload=True)`, with the copies emulated for the trace.

    transformers 5.23 (`_activation_checkpointing_enable`) wraps each checkpoint call in
    `torch.autograd.graph.save_on_cpu(pin_memory=True)`: the tensors the checkpoint
    saves, its positional inputs (the layer's hidden state; keyword arguments such as
    the rotary tables stay referenced as they are), are copied to pinned host memory
    in the forward and back to the device when backward recomputes the layer. Here the
    pack hook counts the host copy in `model.memfit_host_stash` and keeps no device
    tensor; the unpack hook allocates the device copy, as `tensor.to(device)` does.
    """
    from torch.autograd.graph import saved_tensors_hooks

    from hf_memfit.estimator.fast import pinned_host_bytes

    stash = HostStash()
    model.memfit_host_stash = stash

    def pack(tensor):
        nbytes = pinned_host_bytes(tensor.untyped_storage().nbytes())
        stash.live += nbytes
        stash.peak = max(stash.peak, stash.live)
        return tensor.size(), tensor.stride(), tensor.dtype, tensor.requires_grad, nbytes

    def unpack(packed):
        size, stride, dtype, requires_grad, nbytes = packed
        stash.live -= nbytes
        return torch.empty_strided(size, stride, dtype=dtype).requires_grad_(requires_grad)

    for module in model.modules():
        checkpoint = getattr(module, "_gradient_checkpointing_func", None)
        if checkpoint is None:
            continue

        def offloaded(function, *args, _checkpoint=checkpoint, **kwargs):
            with saved_tensors_hooks(pack, unpack):
                return _checkpoint(function, *args, **kwargs)

        module._gradient_checkpointing_func = offloaded


# --- TRL's activation offloading -------------------------------------------------------------

class TrlOffloadedActivations(torch.autograd.graph.saved_tensors_hooks):
    """TRL 1.16's `OffloadActivations` as `SFTConfig(activation_offloading=True)` builds it, re-stated for a trace.

    trl/models/activation_offloading.py, `get_act_offloading_ctx_manager(model)` with its
    defaults (pinned memory, streams, `min_offload_size=1024`, `max_fwd_stash_size=5`),
    entered around every `training_step` (forward, loss and backward). Its rules, kept here:
    - pack (forward): every tensor autograd saves is offloaded unless it is under 1024
      bytes, a parameter (or shares a parameter's storage), or a storage already
      offloaded and still in the forward stash (then it stays on the GPU until it is
      unpacked, and so does every later save of that storage); tensors saved inside the
      `lm_head` / `output` module's forward or a Liger module are not seen (TRL wraps
      them in a `NoOpManager`; TRL's own fused LM head does not call `lm_head`, so its
      tensors are offloaded). A view with a storage offset is cloned on the GPU first
      (a non-contiguous one made contiguous). The copy goes to pinned host memory
      (`empty_like(pin_memory=True)`, rounded by CachingHostAllocator); the GPU tensor
      is kept in a stash until 5 newer tensors have been offloaded (the side stream's
      copy must finish).
    - unpack (backward): a tensor still in the forward stash is used as it is; an
      offloaded one is copied back to a new GPU tensor, kept until the next autograd
      node has run (TRL frees the previous node's tensors in the current node's hook).
    What differs here: no streams or events (they order copies, they allocate
    nothing), and the host copy is counted in `host` (pinned host bytes) instead of
    being made. The trace's emulation of the GPU is this; on a CPU-only torch TRL
    itself cannot build `OffloadActivations` (`torch.accelerator.current_accelerator()`
    is None), so a CPU run has no ground truth to compare with.
    """

    MIN_OFFLOAD_BYTES = 1024  # TRL's min_offload_size default
    FORWARD_STASH = 5  # TRL's max_fwd_stash_size default

    def __init__(self, model):
        self.host = HostStash()
        self.param_storages = {p.untyped_storage()._cdata for p in model.parameters()}
        self.tracker: dict[int, tuple] = {}  # id -> (device tensor kept, None) | (host layout, host bytes)
        self.storage_to_id: dict[tuple, int] = {}
        self.key_of_id: dict[int, tuple] = {}
        self.storage_of_id: dict[int, "weakref.ref"] = {}  # the storage a key was made from
        self.fwd_stash: dict[int, torch.Tensor] = {}
        self.bwd_stash: dict[int, torch.Tensor] = {}
        self.tensor_id = 0
        self.current_node = None
        self._no_offload_in_output_head(model)
        super().__init__(self._pack, self._unpack)

    def _no_offload_in_output_head(self, model) -> None:
        """TRL's `NoOpManager` around the output head's forward (and any module named *liger*)."""
        from torch.autograd.graph import saved_tensors_hooks

        noop = saved_tensors_hooks(lambda t: t, lambda t: t)
        unwrapped = getattr(model, "module", model)
        if hasattr(unwrapped, "base_model") and hasattr(unwrapped, "peft_config"):
            unwrapped = unwrapped.base_model
        heads = [getattr(unwrapped, name) for name in ("output", "lm_head")
                 if isinstance(getattr(unwrapped, name, None), torch.nn.Module)][:1]
        heads += [m for name, m in unwrapped.named_modules() if "liger" in name.lower()]
        for module in heads:
            module.register_forward_pre_hook(lambda *args: noop.__enter__())
            module.register_forward_hook(lambda *args: noop.__exit__(), always_call=True)

    def _track(self, key: tuple, tensor_id: int, storage) -> None:
        self.storage_to_id[key] = tensor_id
        self.key_of_id[tensor_id] = key
        self.storage_of_id[tensor_id] = weakref.ref(storage)

    def _release(self, tensor_id: int) -> None:
        key = self.key_of_id.pop(tensor_id, None)
        self.storage_of_id.pop(tensor_id, None)
        if key is not None and self.storage_to_id.get(key) == tensor_id:
            del self.storage_to_id[key]

    def _offloaded_before(self, key: tuple, storage) -> bool:
        """Whether this very storage is already offloaded and tracked (TRL's deduplication).

        TRL keys storages by address (`data_ptr() + storage_offset()`, dtype); the key here is the
        storage's address in the process, which Python may reuse once a stashed view's base is freed,
        so the tracked storage itself is compared too. (On a GPU the caching allocator can hand a freed
        address to a new tensor while TRL still tracks it, which deduplicates that tensor by mistake:
        not modelled.)
        """
        tensor_id = self.storage_to_id.get(key)
        if tensor_id is None:
            return False
        ref = self.storage_of_id.get(tensor_id)
        if ref is not None and ref() is storage:
            return True
        self._release(tensor_id)  # a stale key: another storage at the same address
        return False

    def _pack(self, activation: torch.Tensor) -> int:
        self.tensor_id += 1
        tensor_id = self.tensor_id
        storage = activation.untyped_storage()
        key = (storage._cdata, activation.storage_offset(), activation.dtype)
        if self._offloaded_before(key, storage):  # already offloaded and still stashed: kept on the GPU
            self.tracker[tensor_id] = (activation, None)
            self._track(key, tensor_id, storage)
            return tensor_id
        if (activation.element_size() * activation.nelement() < self.MIN_OFFLOAD_BYTES
                or isinstance(activation, torch.nn.Parameter) or storage._cdata in self.param_storages):
            self.tracker[tensor_id] = (activation, None)
            return tensor_id
        broadcast = 0 in activation.stride()
        if not broadcast and (not activation.is_contiguous() or activation.storage_offset() != 0):
            activation = (activation.clone(memory_format=torch.contiguous_format) if activation.storage_offset()
                          else activation.contiguous())
        for old in [i for i in self.fwd_stash if i <= tensor_id - self.FORWARD_STASH]:
            del self.fwd_stash[old]
            self._release(old)
        from hf_memfit.estimator.fast import pinned_host_bytes

        host_numel = storage.nbytes() // activation.element_size() if broadcast else activation.numel()
        host = pinned_host_bytes(host_numel * activation.element_size())
        self.host.live += host
        self.host.peak = max(self.host.peak, self.host.live)
        layout = (activation.size(), activation.stride(), activation.storage_offset(), activation.dtype, host_numel)
        self.tracker[tensor_id] = (layout, host)
        self.fwd_stash[tensor_id] = activation
        self._track(key, tensor_id, storage)
        return tensor_id

    def _unpack(self, tensor_id: int) -> torch.Tensor:
        value, host = self.tracker.pop(tensor_id)
        self._release(tensor_id)
        if host is None:
            return value
        self.host.live -= host
        node = torch._C._current_autograd_node()
        previous = []
        if node is not self.current_node:  # a new node: the previous node's tensors go once it has run
            self.current_node = node
            previous = list(self.bwd_stash)
        if tensor_id in self.fwd_stash:
            tensor = self.fwd_stash[tensor_id]
        else:
            size, stride, offset, dtype, numel = value
            tensor = torch.empty(numel, dtype=dtype).as_strided(size, stride, offset)  # `.to(device)`
            self.bwd_stash[tensor_id] = tensor

        def after_node(outputs, inputs):
            self.fwd_stash.clear()  # "if there are still things in the fwd_stash, get rid of them"
            for old in previous:
                self.bwd_stash.pop(old, None)
            return outputs

        if node is not None:
            node.register_hook(after_node)
        return tensor

    def __enter__(self):
        # TRL drops what a previous step left (tensors saved but never unpacked) when the next one starts.
        self.host.live -= sum(host for _, host in self.tracker.values() if host)
        self.tracker.clear()
        self.storage_to_id.clear()
        self.key_of_id.clear()
        self.storage_of_id.clear()
        self.fwd_stash.clear()
        self.bwd_stash.clear()
        self.tensor_id = 0
        self.current_node = None
        return super().__enter__()

    def __exit__(self, *args):
        self.bwd_stash.clear()  # TRL queues this at the end of backward, and clears the stashes on exit
        self.fwd_stash.clear()
        return super().__exit__(*args)


# --- Liger's fused linear cross-entropy, on the CPU ----------------------------------------
# Liger's kernels are Triton (GPU only). What `use_liger_kernel` does to memory is its algorithm
# (liger_kernel/ops/fused_linear_cross_entropy.py), which these functions run with torch ops: the
# same tensors, in the same order; the per-row cross-entropy Triton kernel becomes in-place ops on
# the chunk's logits (plus a few chunk-length vectors the kernel keeps in registers).

def _liger_in_place_accumulation(settings: TrainSettings) -> bool:
    """Liger accumulates grad_weight with an in-place addmm on CUDA sm80+; elsewhere it makes a V x H product."""
    if settings.device != "cuda":
        return False
    if settings.gpu is None:
        return True
    from hf_memfit.hardware import find_gpu

    return find_gpu(settings.gpu).compute_capability >= (8, 0)


class LigerFusedLinearCrossEntropy(torch.autograd.Function):
    """`LigerFusedLinearCrossEntropyFunction` (reduction mean, ignore_index -100), with torch ops."""

    @staticmethod
    @torch.amp.custom_fwd(device_type="cpu")
    def forward(ctx, hidden, weight, target, in_place_accumulation):
        rows, width = hidden.shape
        vocab = weight.shape[0]
        factor = -(-vocab // width)
        chunk = min(rows, 1 << max(0, (-(-rows // factor) - 1).bit_length()))
        grad_input = torch.zeros_like(hidden)
        grad_weight = torch.zeros_like(weight) if weight.requires_grad else None
        loss_1d = torch.zeros(rows, dtype=torch.float32, device=hidden.device)
        target_mask = target != -100
        non_ignored = target_mask.sum()  # Liger reads it with .item(); a 0-d tensor here (fake tensors)
        for start in range(0, rows, chunk):
            end = min(start + chunk, rows)
            x = hidden[start:end]
            logits = x @ weight.t()
            # The cross-entropy kernel: loss per row, and the logits' gradient written over the logits.
            t, keep = target[start:end].clamp(min=0), target_mask[start:end]
            logits.sub_(logits.amax(-1, keepdim=True)).exp_()
            logits.div_(logits.sum(-1, keepdim=True))
            picked = logits.gather(1, t[:, None])[:, 0]
            loss_1d[start:end] = -picked.float().clamp(min=1e-30).log() * keep / non_ignored
            logits.scatter_add_(1, t[:, None], -torch.ones_like(picked)[:, None])
            logits.mul_((keep / non_ignored).to(logits.dtype)[:, None])
            grad_input[start:end] = logits @ weight
            if grad_weight is not None:
                if in_place_accumulation:
                    pass  # CUDA sm80+: torch.addmm(..., out=grad_weight), no temporary
                else:
                    grad_weight += torch.mm(logits.t(), x).float()
            del logits
        ctx.save_for_backward(grad_input.detach(), grad_weight.detach() if grad_weight is not None else None)
        return loss_1d.sum()

    @staticmethod
    def backward(ctx, grad_output):
        grad_input, grad_weight = ctx.saved_tensors
        grad_input.mul_(grad_output)  # Liger's element_mul_kernel, in place
        if grad_weight is not None:
            grad_weight.mul_(grad_output)
        return grad_input, grad_weight, None, None


def _liger_causal_lm_forward(model, in_place_accumulation: bool):
    """The causal-LM forward Liger patches in for training: the body's hidden states straight into the fused loss."""
    from transformers.modeling_outputs import CausalLMOutputWithPast

    body = getattr(model, model.base_model_prefix)
    original = model.forward

    def forward(input_ids=None, labels=None, **kwargs):
        if labels is None:
            return original(input_ids=input_ids, **kwargs)
        hidden = body(input_ids=input_ids, **kwargs)[0]
        shifted = torch.nn.functional.pad(labels, (0, 1), value=-100)[..., 1:].contiguous()
        loss = LigerFusedLinearCrossEntropy.apply(hidden.reshape(-1, hidden.shape[-1]),
                                                  model.get_output_embeddings().weight, shifted.view(-1),
                                                  in_place_accumulation)
        return CausalLMOutputWithPast(loss=loss)

    return forward


def make_batch(settings: TrainSettings, config: dict, device: str = "cpu") -> dict:
    """A batch of the settings' shape: labels = input ids (LM tasks) or class ids (classification).

    TRL batches are what its collators make: DPO stacks the chosen rows over the
    rejected ones, with an attention mask (their lengths differ, so there is
    padding) and a completion mask; padding-free packs every sequence into one
    row whose position ids restart at each sequence. Seq2seq labels have the
    decoder's length.
    """
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


def trainer_optimizer_class(settings: TrainSettings, model=None):
    """The optimizer class and kwargs the HF Trainer builds for `settings.optim` (`Trainer.get_optimizer_cls_and_kwargs`).

    GaLore / APOLLO need the model: their kwargs then carry `params`, the Trainer's
    own groups (projected targets and the rest).
    """
    from transformers import Trainer, TrainingArguments

    targets = settings.optim_target_modules
    if targets == ("all-linear",):
        targets = "all-linear"
    with tempfile.TemporaryDirectory() as tmp:
        args = TrainingArguments(output_dir=tmp, optim=settings.optim, optim_args=settings.optim_args,
                                 optim_target_modules=list(targets) if isinstance(targets, tuple) else targets,
                                 gradient_accumulation_steps=settings.gradient_accumulation_steps, report_to=[])
        return Trainer.get_optimizer_cls_and_kwargs(args, model)


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


def optimizer_step(model, optimizer, *, cuda_semantics: bool = False) -> None:
    """Clip (Trainer default max_grad_norm=1.0), step, and zero the grads to None."""
    params = [p for p in model.parameters() if p.grad is not None]
    torch.nn.utils.clip_grad_norm_(params, 1.0, foreach=True if cuda_semantics else None)
    optimizer.step()
    model.zero_grad(set_to_none=True)
