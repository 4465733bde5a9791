"""The shared currency of both estimator modes: peak candidates, one per region of the step.

A training step's memory peaks in one of a few places: the end of the
forward (activations all live), the start of the backward, the optimizer step
(states and temporaries), or, with accumulation, a later micro-batch with the
gradients already live. Each mode reports the live bytes by category at the
maximum of every such region, for one process on one device with no sharding.
`estimate.py` then applies what is common to both modes (ZeRO sharding,
offload, paging, 4-bit packing, CUDA overheads) to every candidate and takes
the largest. Keeping candidates rather than one total is what lets sharding
move the peak from the optimizer step to the backward, as it does for real.
"""

from dataclasses import dataclass, field

CATEGORIES = ("weights", "gradients", "optimizer", "activations", "temporary", "overhead")

# Region names shared by both modes. Exact mode has more (one per traced
# region); these are the ones fast mode models and the report names.
OPTIMIZER_REGION = "opt"


@dataclass
class StepMemory:
    """Single-device peak candidates for one training step, plus the model facts the later stages need."""

    candidates: dict[str, dict[str, int]]  # region -> bytes by category at the region's maximum
    trainable_params: int
    total_params: int
    largest_param_numel: int
    quantizable_linear_params: int = 0  # Linear weights bitsandbytes would pack to 4 bits
    largest_linear_numel: int = 0
    host_bytes: int = 0  # pinned host memory the step holds (offloaded activation checkpoints)
    notes: list[str] = field(default_factory=list)  # what the mode assumed (MoE routing, calibration)

    @property
    def peak_region(self) -> str:
        return max(self.candidates, key=lambda r: sum(self.candidates[r].values()))

    @property
    def peak_bytes(self) -> int:
        return sum(self.candidates[self.peak_region].values())


def is_optimizer_region(region: str) -> bool:
    return region.split("|")[-1] == OPTIMIZER_REGION
