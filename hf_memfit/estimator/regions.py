"""Which traced regions stand for which regions of the real-depth step: exact mode's region classes.

A traced step's regions are named by the layer running (`1.0|bwd|s0.L5`: step 2, backward, stack 0's
layer 5). A reduced copy traced at 2p and 3p layers (p = the stack's layer period) is extrapolated to the
real depth region by region (`trace.py`), which needs names that mean the same layer at every depth. Those
are the classes: the layers of a stack's first period and of its last one, counted in the order the phase
runs them (`first`, `first+1`, ... and ..., `last-1`, `last`; forward runs layer 0 first, backward the last
layer first).

Why a whole period and not just the first and the last layer: layers at one offset of the pattern form a
series whose bytes at a given point of the layer grow by the same amount per period in forward (each period
keeps its saved activations) and fall by it in backward, so the series' maximum is at its first or its last
member, in the first or the last period. Layers at different offsets differ, though (a Mamba mixer and an
attention layer in Jamba, sliding and global attention in Gemma), so the layer holding the peak need not be
the stack's very first or last one: a tiny Jamba (4 layers, attention at 1 and 3) peaks in the backward of
its layer 2, the Mamba layer run right after the last attention layer, 15% above anything in layer 3's
backward or layer 0's (issue 18); keeping only layers 0 and 3 under-predicted it by 13%.

A trace at the real depth is not extrapolated: there every layer is its own class (`period` None).
"""


def region_class(region: str, depth: int, period: int | None = None) -> list[str]:
    """The class a region of a stack of `depth` layers stands for ([] for a middle layer), or [region] itself.

    `period`: the layers at each end of the stack that are kept (the layer period for a reduced copy that
    is extrapolated; None keeps every layer). A layer that is in both ends (a short stack) is named from
    the nearer one, the first where it is as near to both, so a name means one layer at every depth.
    """
    step, phase, where = region.split("|") if region.count("|") == 2 else (region, "", "")
    if ".L" not in where:
        return [region]
    stack, layer = where.split(".L")
    k = int(layer) if phase == "fwd" else depth - 1 - int(layer)  # layers the phase ran before this one
    j = depth - 1 - k  # layers it runs after it
    ends = depth if period is None else period
    if k < ends and k <= j:
        return [f"{step}|{phase}|{stack}.first" + (f"+{k}" if k else "")]
    if j < ends:
        return [f"{step}|{phase}|{stack}.last" + (f"-{j}" if j else "")]
    return []


def by_class(trace, period: int | None = None) -> dict[str, tuple[int, dict[str, int]]]:
    """Class -> (live bytes, breakdown) at the largest of the trace's regions that stand for it."""
    out = {}
    for region, live in trace.region_peaks.items():
        stack = region.split("|")[-1].split(".")[0] if "|" in region else ""
        depth = depth_of(stack, trace.stack_depths or trace.depths)
        for cls in region_class(region, depth, period):
            if cls not in out or live > out[cls][0]:
                out[cls] = (live, trace.region_breakdowns[region])
    return out


def depth_of(stack: str, depths: tuple[int, ...]) -> int:
    """The traced depth of stack `s<i>`."""
    index = int(stack[1:]) if stack.startswith("s") and stack[1:].isdigit() else 0
    return depths[min(index, len(depths) - 1)]
