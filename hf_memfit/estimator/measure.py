"""Ground truth on the CPU: the allocator's real peak over a real training step.

The PyTorch profiler with `profile_memory=True` records every CPU allocator
event as a `[memory]` event with a signed byte count. Sorted by time, their
running sum is what the allocator holds, and its maximum, from model creation
through the last optimizer step, is the measured peak. The step is the same
code the exact estimator traces (`step.py`), run on real tensors.
"""

import gc

import torch

from hf_memfit.estimator import step as training
from hf_memfit.settings import TrainSettings


def measure_cpu_peak(config: dict, settings: TrainSettings, *, steps: int = 2, seed: int = 0) -> int:
    """Run `steps` real optimizer steps on the CPU and return the allocator's peak bytes."""
    from torch.profiler import ProfilerActivity, profile

    torch.manual_seed(seed)
    # Garbage from before (tensors in reference cycles) freed by a collection inside the window would count as
    # frees of this run's memory and lower its peak: collect it first.
    gc.collect()
    with training.cuda_synchronize_without_cuda(), \
            profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        model = training.build_model(config, settings)
        optimizer = training.make_optimizer(model, settings)
        for _ in range(steps):
            for _ in range(min(settings.gradient_accumulation_steps, 2)):
                batch = training.make_batch(settings, config)
                training.forward_backward(model, batch, settings, device_type="cpu")
                del batch
            training.optimizer_step(model, optimizer)
        del model, optimizer
    events = [e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"]
    events.sort(key=lambda e: e.start_ns())
    live = peak = 0
    for event in events:
        live += event.nbytes()
        peak = max(peak, live)
    return peak
