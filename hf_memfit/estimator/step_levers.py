"""The memory levers of a training step that change what it keeps: offloaded checkpoints, TRL's activation
offloading, Liger's fused linear cross-entropy and ALST's TiledMLP, each as the library runs it
(`step.build_model` installs them).
"""

import weakref

import torch

from hf_memfit.estimator.pinned_host import HostStash
from hf_memfit.settings import TrainSettings

# --- activation checkpoints offloaded to the host -------------------------------------------

def offload_checkpoint_inputs(model) -> None:
    """transformers' `activation_checkpointing_enable(offload=True)`, with the copies emulated for the trace.

    transformers 5.23 (`_activation_checkpointing_enable`) wraps each checkpoint call in
    `torch.autograd.graph.save_on_cpu(pin_memory=True)`: the tensors the checkpoint
    saves, its positional inputs (the layer's hidden state; keyword arguments such as
    the rotary tables stay referenced as they are), are copied to pinned host memory
    in the forward and back to the device when backward recomputes the layer. Here the
    pack hook counts the host copy in `model.memfit_host_stash` and keeps no device
    tensor; the unpack hook allocates the device copy, as `tensor.to(device)` does. A
    copy no backward unpacks (a layer whose output nothing reads: LLaVA's last CLIP
    layer) is freed with the graph that holds it, as the host tensor is.
    """
    from torch.autograd.graph import saved_tensors_hooks

    stash = HostStash()
    model.memfit_host_stash = stash

    def pack(tensor):
        return _HostCopy(stash, stash.add(tensor.untyped_storage().nbytes()),
                         (tensor.size(), tensor.stride(), tensor.dtype, tensor.requires_grad))

    def unpack(copy):
        size, stride, dtype, requires_grad = copy.layout
        copy.free()
        return torch.empty_strided(size, stride, dtype=dtype).requires_grad_(requires_grad)

    for module in model.modules():
        checkpoint = getattr(module, "_gradient_checkpointing_func", None)
        if checkpoint is None:
            continue

        def offloaded(function, *args, _checkpoint=checkpoint, **kwargs):
            with saved_tensors_hooks(pack, unpack):
                return _checkpoint(function, *args, **kwargs)

        module._gradient_checkpointing_func = offloaded


class _HostCopy:
    """An offloaded tensor's host copy, as the autograd graph holds it: freed when unpacked, or with the graph."""

    __slots__ = ("stash", "token", "layout")

    def __init__(self, stash: HostStash, token: int, layout: tuple):
        self.stash, self.token, self.layout = stash, token, layout

    def free(self) -> None:
        if self.token is not None:
            self.stash.remove(self.token)
            self.token = None

    def __del__(self):
        self.free()


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
        # id -> (device tensor kept, its `host` token or None, False) | (host layout, its `host` token, True)
        self.tracker: dict[int, tuple] = {}
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
            self.tracker[tensor_id] = (activation, None, False)
            self._track(key, tensor_id, storage)
            return tensor_id
        if isinstance(activation, torch.nn.Parameter) or storage._cdata in self.param_storages:
            self.tracker[tensor_id] = (activation, None, False)
            return tensor_id
        broadcast = 0 in activation.stride()
        host_numel = storage.nbytes() // activation.element_size() if broadcast else activation.numel()
        nbytes = activation.element_size() * activation.nelement()
        if nbytes < self.MIN_OFFLOAD_BYTES:  # kept on the GPU; held at no host bytes, for the fits to see it grow
            self.tracker[tensor_id] = (activation, self.host.add(host_numel * activation.element_size(), nbytes,
                                                                 self.MIN_OFFLOAD_BYTES), False)
            return tensor_id
        if not broadcast and (not activation.is_contiguous() or activation.storage_offset() != 0):
            activation = (activation.clone(memory_format=torch.contiguous_format) if activation.storage_offset()
                          else activation.contiguous())
        for old in [i for i in self.fwd_stash if i <= tensor_id - self.FORWARD_STASH]:
            del self.fwd_stash[old]
            self._release(old)
        host = self.host.add(host_numel * activation.element_size(), nbytes, self.MIN_OFFLOAD_BYTES)
        layout = (activation.size(), activation.stride(), activation.storage_offset(), activation.dtype, host_numel)
        self.tracker[tensor_id] = (layout, host, True)
        self.fwd_stash[tensor_id] = activation
        self._track(key, tensor_id, storage)
        return tensor_id

    def _unpack(self, tensor_id: int) -> torch.Tensor:
        value, host, offloaded = self.tracker.pop(tensor_id)
        self._release(tensor_id)
        if host is not None:
            self.host.remove(host)
        if not offloaded:
            return value
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
        for _, host, _ in self.tracker.values():
            if host is not None:
                self.host.remove(host)
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

def liger_in_place_accumulation(settings: TrainSettings) -> bool:
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


def liger_causal_lm_forward(model, in_place_accumulation: bool):
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


# --- ALST's TiledMLP ----------------------------------------------------------------------------

def tiled_mlp_modules(model) -> list:
    """The per-layer MLPs TiledMLP wraps: each repeated layer's dense `mlp` child (`models.generic.dense_mlps`).

    ALST patches the dense MLP class's forward (its `tiled_mlp_forward` example replaces `LlamaMLP.forward`).
    """
    from hf_memfit.models.generic import dense_mlps, layer_stacks

    return [mlp for _, stack in layer_stacks(model) for mlp in dense_mlps(stack)]


def deepspeed_import(name: str):
    """Import a DeepSpeed module with DeepSpeed's log on stderr.

    DeepSpeed's logger writes to whatever `sys.stdout` was when it was first imported
    (deepspeed/utils/logging.py, `StreamHandler(stream=sys.stdout)`), and on a machine without a GPU its
    accelerator check warns there on import: a line before `hf-memfit ... --json`'s JSON. Imported with
    stdout pointed at stderr, the handler keeps stderr for good.

    That warning ("Setting accelerator to CPU. If you have GPU or other accelerator, we were unable to detect it",
    deepspeed/accelerator/real_accelerator.py `get_accelerator`) is about the machine hf-memfit plans on, which
    traces DeepSpeed's code and never runs it on an accelerator, not the GPU it plans for: it is left out. A filter
    on DeepSpeed's logger outlives its creation during the import (`LoggerFactory.create_logger` sets the level and
    the handler, not the filters).
    """
    import contextlib
    import importlib
    import logging
    import sys

    def not_accelerator_detection(record: logging.LogRecord) -> bool:
        return not (record.funcName == "get_accelerator" and record.levelno == logging.WARNING)

    logger = logging.getLogger("DeepSpeed")
    logger.addFilter(not_accelerator_detection)
    try:
        with contextlib.redirect_stdout(sys.stderr):
            return importlib.import_module(name)
    finally:
        logger.removeFilter(not_accelerator_detection)


def tile_mlps(model, hidden_size: int) -> int:
    """Run every layer's MLP through DeepSpeed's `TiledMLP`, as ALST's `tiled_mlp_forward` does; returns how many.

    deepspeed/runtime/sequence_parallel/ulysses_sp.py `TiledMLP`: the forward runs the MLP
    shard by shard under `no_grad` and saves only its input; the backward recomputes each
    shard with grad and backpropagates it into a gradient buffer the size of the input. The
    shard count is all-reduced to the maximum over ranks in ALST's example; one process needs
    no reduction. `compute_params` is ALST's list of the MLP's weights (for ZeRO's hooks).
    """
    from hf_memfit.models.tiling import tiled_mlp_shards

    TiledMLP = deepspeed_import("deepspeed.runtime.sequence_parallel.ulysses_sp").TiledMLP

    mlps = tiled_mlp_modules(model)
    for mlp in mlps:
        original = mlp.forward
        params = [p for p in mlp.parameters()]

        def tiled_forward(x, _original=original, _mlp=mlp, _params=params):
            shards = tiled_mlp_shards(x.shape[-2], hidden_size)
            return TiledMLP.apply(lambda _self, shard: _original(shard), _mlp, x, shards, _params)

        mlp.forward = tiled_forward
    return len(mlps)
