"""Freezing a tower beside the trained model (`plan(allow_freeze=True)`, `--allow-freeze`): what is tried, and why.

The candidates are the model's own (`models/freezable.py`, found by structure): a VLM's vision tower, a
wav2vec2 / HuBERT feature encoder (what `freeze_feature_encoder()` freezes), Whisper's encoder (what
`freeze_encoder()` freezes). A frozen tower keeps no gradients and no optimizer state, and since nothing
before it needs a gradient, autograd runs none of its backward: it saves no activations for it and costs its
forward only.

When: freezing changes what is trained, so like pure bf16 it is opt-in and, even when allowed, used only when
no plan that trains every module fits. It is always at least as fast (less backward, a smaller optimizer
step), so as a speed lever it would be chosen every time it is allowed, and "allowed" would mean "do it"; a
user who wants the tower frozen anyway says so with `--freeze` (or by freezing it in the model, which the
trainers read). It comes before pure bf16 when both are allowed: frozen towers are these models' common
recipe (LLaVA trains with its vision tower frozen; transformers' wav2vec2 examples call
`freeze_feature_encoder()`), and what stays trained keeps its numerics. The least frozen set that fits wins:
each candidate alone, smallest first, then together. LoRA runs are not offered it: peft already freezes the
base, and what stays trained there is the adapters (`--lora-target-modules`).
"""

from itertools import combinations

from hf_memfit.errors import MemFitError
from hf_memfit.settings import TrainSettings
from hf_memfit.units import format_bytes, format_count

# Above this many candidates only "all of them" is tried, not every subset (no model here has more than two).
MAX_SUBSET_CANDIDATES = 3


def freezable(spec, base: TrainSettings) -> list[dict]:
    """The model's freezable towers that `base` trains: not LoRA, not already frozen (by the user or the model)."""
    if base.uses_lora:
        return []
    already = tuple(base.frozen or ())
    return [m for m in spec.freezable_modules(base.task, base.num_labels)
            if not any(m["module"] == f or m["module"].startswith(f + ".") for f in already)]


def freeze_options(spec, base: TrainSettings, allow_freeze: bool) -> list[tuple[str, ...]]:
    """The frozen-module sets to try, in order, each with what `base` already freezes: least frozen first."""
    towers = freezable(spec, base) if allow_freeze else []
    if not towers:
        return []
    subsets = ([c for r in range(1, len(towers) + 1) for c in combinations(towers, r)]
               if len(towers) <= MAX_SUBSET_CANDIDATES else [tuple(towers)])
    subsets.sort(key=lambda c: sum(m["params"] for m in c))
    return [tuple(base.frozen or ()) + tuple(m["module"] for m in c) for c in subsets]


def newly_frozen(base: TrainSettings, chosen: TrainSettings) -> tuple[str, ...]:
    """The modules the plan froze beyond what the run already froze."""
    return tuple(m for m in chosen.frozen or () if m not in (base.frozen or ()))


def freeze_reason(spec, best, candidates, base: TrainSettings) -> str:
    """Why the plan froze these towers: what nothing trained fits in, and what freezing them keeps out."""
    froze = newly_frozen(base, best.settings)
    towers = {m["module"]: m for m in spec.freezable_modules(base.task, base.num_labels)}
    total = best.estimate.total_params or 1
    named = ", ".join(f"`{name}` ({towers[name]['kind']}, {format_count(towers[name]['params'])} parameters, "
                      f"{100 * towers[name]['params'] / total:.0f}% of the model)" if name in towers else f"`{name}`"
                      for name in froze)
    trained = [c for c in candidates if not newly_frozen(base, c.settings)]
    least = min(trained, key=lambda c: c.estimate.device_total_bytes, default=None)
    why = "nothing fits with every module trained" + (f": the smallest such plan {least.why_not}"
                                                      if least is not None and least.why_not else "")
    return (f"frozen {named}, allowed by `--allow-freeze` ({why}): its parameters keep no gradients or "
            f"optimizer state and, with nothing before it needing a gradient, it runs no backward and saves no "
            f"activations for one; {best.estimate.trainable_params:,} of {total:,} parameters are trained. "
            "`MemFitTrainer` freezes it before building the optimizer; in your own script call `requires_grad_(False)` "
            "on it (or the model's own freeze method)")


def freeze_remedy(spec, base: TrainSettings, grid, evaluate) -> str | None:
    """The `--allow-freeze` remedy a refusal names: the least-frozen set that fits, with its peak, or None.

    `grid(frozen_base)` yields the settings to try for a frozen base; `evaluate(settings)` is a `Candidate`.
    """
    for frozen in freeze_options(spec, base, allow_freeze=True):
        fits = [c for c in (_evaluated(evaluate, s) for s in grid(base.replace(frozen=frozen))) if c and c.fits]
        if fits:
            least = min(fits, key=lambda c: c.estimate.device_total_bytes)
            names = ", ".join(newly_frozen(base, least.settings))
            return f"`--allow-freeze` ({format_bytes(least.estimate.device_total_bytes)}: freezes {names})"
    return None


def _evaluated(evaluate, settings):
    """The candidate, or None for settings the estimate refuses (the remedy names only what was estimated)."""
    try:
        return evaluate(settings)
    except MemFitError:
        return None
