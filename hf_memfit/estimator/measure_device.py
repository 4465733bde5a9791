"""A real training step on this machine, measured: what `hf-memfit check` compares the prediction with.

The step is `step.py`'s, the code exact mode traces and the accuracy benchmark
measures, run on real tensors with random weights (the model built from its config).

- **CPU**: the peak is `measure.measure_cpu_peak`, the benchmarks' ground truth
  (the running sum of the profiler's allocator events). A second, identical run
  under the profiler's memory analysis (`torch.profiler._memory_profiler`, what
  `export_memory_timeline` draws) splits the live bytes at its own peak into the
  profiler's categories, which map onto the estimate's breakdown (`PROFILER_TERMS`).
- **CUDA**: `torch.cuda.reset_peak_memory_stats`, then `max_memory_allocated` /
  `max_memory_reserved` over model creation and the steps; the process's own
  device memory as nvidia-smi shows it (NVML where `pynvml` is installed, else the
  device-wide used memory); the cuBLAS workspaces (the allocator's growth over a
  forward and backward matmul before the model exists) and the CUDA context (the
  device memory the process uses beyond what the allocator reserved). 4-bit QLoRA
  and LLM.int8() load the random weights through bitsandbytes as `from_pretrained` does.
  This path has not run on the machine the package was written on (no GPU there);
  `tests/test_check.py::test_check_on_cuda` runs it where there is one.
"""

import contextlib
import dataclasses
import gc
import os
import time

import torch

from hf_memfit.estimator import step as training
from hf_memfit.estimator.measure import bitsandbytes_build, measure_cpu_peak, one_intra_op_thread
from hf_memfit.settings import TrainSettings

# The profiler's categories (torch/profiler/_memory_profiler.py `Category`) as the estimate's breakdown names them.
# INPUT is the batch, which the estimator counts with the activations it feeds; AUTOGRAD_DETAIL is autograd's
# own scratch (e.g. the loss's backward seed, the gradient buffers in flight) and TEMPORARY what the profiler could
# not tie to a longer life: both are the estimate's `temporary`. Bytes with no tensor behind them go there too.
PROFILER_TERMS = {"PARAMETER": "weights", "GRADIENT": "gradients", "OPTIMIZER_STATE": "optimizer",
                  "ACTIVATION": "activations", "INPUT": "activations", "TEMPORARY": "temporary",
                  "AUTOGRAD_DETAIL": "temporary", None: "temporary"}


@dataclasses.dataclass
class Measurement:
    """What one real run of `steps` training steps held at its peak, in bytes."""

    device: str
    steps: int
    peak_allocated_bytes: int
    peak_reserved_bytes: int | None = None  # CUDA: the caching allocator's cached segments at the peak
    device_total_bytes: int | None = None  # CUDA: what nvidia-smi shows for this process
    terms: dict[str, int] | None = None  # the breakdown at the measured peak, where it can be attributed
    constants: dict[str, int] = dataclasses.field(default_factory=dict)  # CUDA: workspace, context, ...
    seconds: float = 0.0
    notes: list[str] = dataclasses.field(default_factory=list)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def measure_step(config: dict, settings: TrainSettings, *, steps: int = 2, terms: bool = True,
                 memory_snapshot: str | None = None) -> Measurement:
    """Run `steps` real training steps of `settings` on `settings.device` and measure them.

    On CUDA, `memory_snapshot` names a file for the caching allocator's history of the run
    (`torch.cuda.memory._dump_snapshot`, which pytorch.org/memory_viz draws): every block
    alive at the peak, with the Python stack that allocated it.
    """
    started = time.perf_counter()
    if settings.device == "cuda":
        result = _measure_cuda(config, settings, steps, memory_snapshot)
    else:
        result = Measurement("cpu", steps, measure_cpu_peak(config, settings, steps=steps))
        result.peak_reserved_bytes = result.device_total_bytes = result.peak_allocated_bytes
        if terms:
            try:
                result.terms, analysed_peak = cpu_terms_at_peak(config, settings, steps=steps)
            except Exception as error:  # noqa: BLE001 - a private torch analysis; the measured peak stands without it
                result.notes.append(f"no term-by-term split: the profiler's memory analysis failed "
                                    f"({type(error).__name__}: {str(error).splitlines()[0][:200] if str(error) else ''})")
                analysed_peak = result.peak_allocated_bytes
            if analysed_peak != result.peak_allocated_bytes:
                result.notes.append(f"the attributed run peaked at {analysed_peak} B, the measured one at "
                                    f"{result.peak_allocated_bytes} B (its analysis follows tensors, not every allocator event)")
    result.seconds = time.perf_counter() - started
    return result


def cpu_terms_at_peak(config: dict, settings: TrainSettings, *, steps: int = 2) -> tuple[dict[str, int], int]:
    """The live bytes by breakdown term at the peak of a profiled CPU run, and that peak.

    The same loop as `measure_cpu_peak`, on one intra-op thread as it is, under a profiler that also records
    shapes and stacks, which its memory analysis needs to follow each tensor's role.
    """
    from torch.profiler import ProfilerActivity, profile
    from torch.profiler._memory_profiler import (
        _CATEGORY_TO_INDEX,
        MemoryProfileTimeline,
    )

    torch.manual_seed(0)
    with training.cuda_synchronize_without_cuda(), bitsandbytes_build(settings, "cpu"), one_intra_op_thread(), \
            profile(activities=[ProfilerActivity.CPU], profile_memory=True, record_shapes=True,
                    with_stack=True) as prof:
        model = training.build_model(config, settings)
        optimizer = training.make_optimizer(model, settings)
        for _ in range(steps):
            for _ in range(min(settings.gradient_accumulation_steps, 2)):
                batch = training.make_batch(settings, config)
                training.forward_backward(model, batch, settings, device_type="cpu")
                del batch
            training.optimizer_step(model, optimizer)
        del model, optimizer
    _, sizes = MemoryProfileTimeline(prof._memory_profile())._coalesce_timeline("cpu")
    # column 0 is memory with no tensor key; the others follow _CATEGORY_TO_INDEX
    names = [None] + [category.name if category is not None else None for category in _CATEGORY_TO_INDEX]
    at_peak = max(sizes, key=sum)
    terms: dict[str, int] = {}
    for name, size in zip(names, at_peak):
        term = PROFILER_TERMS.get(name, "temporary")
        terms[term] = terms.get(term, 0) + int(size)
    return terms, int(sum(at_peak))


# --- CUDA ----------------------------------------------------------------------------------------------


# Allocator events a snapshot keeps (the newest): a few training steps of a small model stay well inside it.
SNAPSHOT_MAX_ENTRIES = 100_000


def _measure_cuda(config: dict, settings: TrainSettings, steps: int, memory_snapshot: str | None = None) -> Measurement:
    # The run uses the allocator the settings predict (`--expandable-segments`), whatever PYTORCH_CUDA_ALLOC_CONF
    # says; the setting applies to segments made from here on, which is every one of the measured run's.
    torch.cuda.memory._set_allocator_settings(
        f"expandable_segments:{'True' if settings.expandable_segments else 'False'}")
    torch.cuda.init()
    # A row of `check --grid` runs after others in the same process: a model or optimizer they left in reference
    # cycles (hooks, closures) keeps its device memory until the cycle collector runs, and would count in this
    # row's peak (the CPU path collects for the same reason: measure.profiled_allocations).
    gc.collect()
    torch.cuda.empty_cache()
    torch.cuda.synchronize()
    torch.manual_seed(0)
    constants = {"cublas_workspace_bytes": cublas_workspace_probe(settings)}
    torch.cuda.reset_peak_memory_stats()  # the workspaces stay allocated, so the peaks below include them
    if memory_snapshot:
        torch.cuda.memory._record_memory_history(max_entries=SNAPSHOT_MAX_ENTRIES, stacks="python")
    try:
        model, optimizer = build_on_cuda(config, settings)
        train_on_cuda(model, optimizer, config, settings, steps)
        torch.cuda.synchronize()
        if memory_snapshot:
            torch.cuda.memory._dump_snapshot(memory_snapshot)
    finally:
        if memory_snapshot:
            torch.cuda.memory._record_memory_history(enabled=None)
    allocated, reserved = torch.cuda.max_memory_allocated(), torch.cuda.max_memory_reserved()
    # The context is what the process holds beyond the allocator's segments, read after the steps: kernels load
    # lazily (CUDA_MODULE_LOADING=LAZY), so only now does it hold a training step's kernel images, as predicted.
    constants["cuda_context_bytes"] = process_device_bytes() - torch.cuda.memory_reserved()
    constants["allocator_reserved_minus_allocated_bytes"] = reserved - allocated
    total = constants["cuda_context_bytes"] + reserved  # nvidia-smi at the peak: the context and every segment
    del model, optimizer
    notes = [] if _nvml() is not None else [
        "no pynvml: the device total is the whole device's used memory, other processes included"]
    return Measurement("cuda", steps, allocated, reserved, total, None, constants, notes=notes)


def build_on_cuda(config: dict, settings: TrainSettings):
    """The model (plus adapters) and optimizer of `settings` on the GPU, 4-bit bases packed by bitsandbytes."""
    # A bitsandbytes build places itself (`from_pretrained(device_map=...)`, and peft puts each adapter on its base
    # layer's device); everything else is built straight on the GPU.
    placement = contextlib.nullcontext() if settings.load_in_kbit else torch.device("cuda")
    with bitsandbytes_build(settings, torch.cuda.current_device()), placement:
        # Liger's own Triton kernels, not the stand-in exact mode traces: applied below as the Trainer applies them
        model = training.build_model(config, settings.replace(use_liger_kernel=False))
    if settings.use_liger_kernel:
        from transformers.integrations.liger import apply_liger_kernel  # Trainer.__init__ with use_liger_kernel

        apply_liger_kernel(model, None)
    if not settings.load_in_kbit:
        # A parameter made by the legacy constructor ignores the device context (wav2vec2's `masked_spec_embed =
        # nn.Parameter(torch.Tensor(hidden_size))` stayed on the CPU, and SpecAugment's indexing failed); a
        # user's model is moved whole, by `.to(device)` or the Trainer. A no-op for everything already there.
        model.to("cuda")
    return model, training.make_optimizer(model, settings, cuda_semantics=True)


def train_on_cuda(model, optimizer, config: dict, settings: TrainSettings, steps: int) -> None:
    """`steps` optimizer steps of `settings` (at most two micro-batches each: the second accumulates)."""
    for _ in range(steps):
        for _ in range(min(settings.gradient_accumulation_steps, 2)):
            batch = training.make_batch(settings, config, device="cuda")
            training.forward_backward(model, batch, settings, device_type="cuda")
            del batch
        training.optimizer_step(model, optimizer, cuda_semantics=True)


def measure_varying(config: dict, settings: TrainSettings, shapes: list[tuple[int, int | None]],
                    *, progress=None) -> dict:
    """A run of micro-batches of the given shapes, an optimizer step every `gradient_accumulation_steps`, as a
    training run with dynamic padding makes them: on CUDA, the running `max_memory_allocated` /
    `max_memory_reserved` after each micro-batch, and where the run ran out of memory if it did.

    `check` measures one shape, the largest, which is what the estimate is for. Over many shapes the caching
    allocator keeps the segments each shape made, so a card with room reserves more than one step did (docs/
    benchmarks.md section 19: 1.12-2.24x), cache it frees and retries with before it raises an OOM
    (`num_alloc_retries`). On the CPU the run goes through the same steps and reads no allocator (zeros)."""
    cuda = settings.device == "cuda"
    if cuda:
        torch.cuda.memory._set_allocator_settings(  # the allocator the settings predict, as `_measure_cuda` sets it
            f"expandable_segments:{'True' if settings.expandable_segments else 'False'}")
        gc.collect()
        torch.cuda.empty_cache()  # a fresh allocator, as a fresh run has: nothing cached by an earlier row
        cublas_workspace_probe(settings)
        torch.cuda.reset_peak_memory_stats()
        model, optimizer = build_on_cuda(config, settings)
    else:
        model = training.build_model(config, settings)
        optimizer = training.make_optimizer(model, settings)
    read = (lambda name: int(getattr(torch.cuda, name)())) if cuda else (lambda name: 0)
    device = "cuda" if cuda else "cpu"
    trace, oom, started = [], None, time.perf_counter()
    for index, (seq_len, side) in enumerate(shapes):
        shaped = settings.replace(seq_len=seq_len, image_size=side)
        stepped = (index + 1) % settings.gradient_accumulation_steps == 0
        try:
            batch = training.make_batch(shaped, config, device=device)
            training.forward_backward(model, batch, shaped, device_type=device)
            del batch
            if stepped:
                training.optimizer_step(model, optimizer, cuda_semantics=cuda)
        except torch.OutOfMemoryError as error:  # where this card would have stopped the run
            oom = {"micro_batch": index, "seq_len": seq_len, "image_size": side,
                   "error": str(error).splitlines()[0][:300]}
            break
        if cuda:
            torch.cuda.synchronize()
        trace.append({"seq_len": seq_len, "image_size": side, "optimizer_step": stepped,
                      "max_allocated": read("max_memory_allocated"), "max_reserved": read("max_memory_reserved"),
                      "reserved": read("memory_reserved")})
        if progress is not None:
            progress(index + 1, len(shapes), trace[-1])
    stats = torch.cuda.memory_stats() if cuda else {}
    result = {"micro_batches": len(shapes), "run": len(trace), "oom": oom,
              "seconds": round(time.perf_counter() - started, 1),
              "max_allocated": read("max_memory_allocated"), "max_reserved": read("max_memory_reserved"),
              "num_alloc_retries": int(stats.get("num_alloc_retries", 0)), "num_ooms": int(stats.get("num_ooms", 0)),
              "trace": trace}
    del model, optimizer
    return result


def cublas_workspace_probe(settings: TrainSettings) -> int:
    """The allocator bytes cuBLAS keeps after a matmul forward (main thread) and backward (autograd's thread).

    cuBLAS takes its workspace from the caching allocator per handle, and a training
    process has a handle on each thread that runs matmuls; the workspaces stay allocated.
    """
    dtype = training.torch_dtype(settings.compute_dtype)
    before = torch.cuda.memory_allocated()
    a = torch.randn(64, 64, device="cuda", dtype=dtype, requires_grad=True)
    b = torch.randn(64, 64, device="cuda", dtype=dtype, requires_grad=True)
    (a @ b).sum().backward()
    torch.cuda.synchronize()
    del a, b
    return torch.cuda.memory_allocated() - before


def _nvml():
    try:
        import pynvml

        pynvml.nvmlInit()
        return pynvml
    except Exception:  # noqa: BLE001 - not installed or no driver library: fall back to the device-wide figure
        return None


def process_device_bytes() -> int:
    """This process's device memory as nvidia-smi lists it (NVML), else the device's used memory."""
    nvml = _nvml()
    if nvml is not None:
        index = torch.cuda.current_device()
        handle = nvml.nvmlDeviceGetHandleByIndex(index)
        for process in nvml.nvmlDeviceGetComputeRunningProcesses(handle):
            if process.pid == os.getpid() and process.usedGpuMemory is not None:
                return int(process.usedGpuMemory)
    free, total = torch.cuda.mem_get_info()
    return int(total - free)
