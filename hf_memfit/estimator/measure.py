"""Ground truth on the CPU: the allocator's real peak over a real training step.

The PyTorch profiler with `profile_memory=True` records every CPU allocator
event as a `[memory]` event with a signed byte count. Sorted by time, their
running sum is what the allocator holds, and its maximum, from model creation
through the last optimizer step, is the measured peak. The step is the same
code the exact estimator traces (`step.py`), run on real tensors.
"""

import gc
import tempfile
from contextlib import contextmanager

import torch

from hf_memfit.estimator import step as training
from hf_memfit.settings import TrainSettings
from hf_memfit.tasks import MEDIA_TASKS


def measure_cpu_peak(config: dict, settings: TrainSettings, *, steps: int = 2, seed: int = 0) -> int:
    """Run `steps` real optimizer steps on the CPU and return the allocator's peak bytes (on one intra-op thread:
    `one_intra_op_thread`)."""
    torch.manual_seed(seed)
    with training.cuda_synchronize_without_cuda(), bitsandbytes_build(settings, "cpu"), one_intra_op_thread(), \
            profiled_allocations() as prof:
        model = training.build_model(config, settings)
        optimizer = training.make_optimizer(model, settings)
        for _ in range(steps):
            # Image, audio and VLM batches are held as the Trainer holds them (`assemble.held_batches`): every
            # micro-batch of the step from before its first forward through its optimizer step, and the batch
            # accelerate's dataloader has fetched ahead.
            held = [training.make_batch(settings, config) for _ in range(settings.gradient_accumulation_steps + 1)] \
                if settings.task in MEDIA_TASKS else []
            for micro in range(min(settings.gradient_accumulation_steps, 2)):
                batch = held[micro] if held else training.make_batch(settings, config)
                training.forward_backward(model, batch, settings, device_type="cpu")
                del batch
            training.optimizer_step(model, optimizer)
            del held
        del model, optimizer
    return allocator_peak(prof)


@contextmanager
def one_intra_op_thread():
    """While open, torch runs its CPU kernels on one thread.

    Some CPU kernels take scratch memory per thread, inside the kernel, where no traced op sees it: CPU flash
    attention (`_scaled_dot_product_flash_attention_for_cpu` and its backward) and the conv1d of wav2vec2's front
    end. Its size follows the machine's core count and instruction set: on a 2-core AVX2 machine, two threads
    took 2 x 4,352 B per attention call where one took 2 x 2,176 B, and a tiny Qwen2.5-VL step measured 5,428,364 B
    on two threads and 5,228,172 B (exact mode's figure to the byte) on one. None of it exists on a GPU, which is
    what the estimate is for, so the ground truth is taken where it is smallest and the same on every machine.
    """
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


@contextmanager
def profiled_allocations():
    """The PyTorch profiler recording every CPU allocator event, started on a collected heap.

    Objects an earlier step left in reference cycles (a model with hooks, say) are freed whenever the cycle
    collector next runs. Their blocks, allocated under an earlier profiler run, then show up as negative
    `[memory]` events inside this window and lower its running sum: a test measured after another read 21% low
    (600 KiB of the previous test's model freed while this one was built). Collecting first keeps the window's
    events to what it allocates.
    """
    from torch.profiler import ProfilerActivity, profile

    gc.collect()
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        yield prof


def allocator_peak(prof, *, from_marker_bytes: int | None = None) -> int:
    """The allocator's peak in a profiler run: the maximum running sum of its `[memory]` events sorted by time.

    With `from_marker_bytes`, only maxima from the first allocation of exactly that size on are taken (bytes
    live before it still count): a benchmark allocates such a marker where its training steps begin.
    """
    events = sorted((e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"),
                    key=lambda e: e.start_ns())
    live = peak = 0
    started = from_marker_bytes is None
    for event in events:
        live += event.nbytes()
        started = started or event.nbytes() == from_marker_bytes
        if started:
            peak = max(peak, live)
    return peak


@contextmanager
def bitsandbytes_build(settings: TrainSettings, device):
    """While open, `build_model` gets base weights bitsandbytes packed, as a real run has them (else a no-op).

    A measurement must run the real layers, not the stand-ins exact mode traces (`build_model` keeps a 4-bit
    base in the compute dtype, and runs an int8 one through `int8_matmul.like_linear8bit`: fake tensors cannot
    be packed). Here its `instantiate` is swapped for one that saves the random weights and loads them back
    with a `BitsAndBytesConfig` onto `device`, which is how `from_pretrained` quantises a checkpoint;
    `build_model` then adds checkpointing, peft's own `prepare_model_for_kbit_training` (it finds the packed
    parameters) and the adapters as usual. bitsandbytes 0.50 runs int8 layers on the CPU too (`MatMul8bitFp`);
    4-bit ones are packed on a GPU only (`check` refuses them on the CPU).
    """
    if not (settings.load_in_8bit or (settings.load_in_4bit and device != "cpu")):
        yield  # a 4-bit step on the CPU is measured as the stand-in (tests/test_qlora.py), not the GPU path
        return
    from transformers import BitsAndBytesConfig

    from hf_memfit.models.build import auto_model_class

    original = training.instantiate
    storage = settings.bnb_4bit_quant_storage or "uint8"

    def quantized(config, task, num_labels, *, dtype, attn_implementation):
        quant = BitsAndBytesConfig(load_in_8bit=True) if settings.load_in_8bit else BitsAndBytesConfig(
            load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=dtype,
            bnb_4bit_use_double_quant=settings.bnb_4bit_use_double_quant,
            bnb_4bit_quant_storage=getattr(torch, storage))
        with tempfile.TemporaryDirectory(prefix="hf-memfit-check-") as folder:
            with torch.device("cpu"):  # the random weights never reach the device unpacked
                original(config, task, num_labels, dtype=dtype, attn_implementation=attn_implementation) \
                    .save_pretrained(folder)
            return auto_model_class(task).from_pretrained(folder, quantization_config=quant, dtype=dtype,
                                                          attn_implementation=attn_implementation or "sdpa",
                                                          device_map={"": device})

    training.instantiate = quantized
    try:
        yield
    finally:
        training.instantiate = original
