"""The depths a model is traced at, and the steps that extrapolate its bytes to the real depth.

Exact mode and the fitted fast modes (`parametric.py`, `batch_fit.py`) trace copies of the model with few
layers and extrapolate linearly in the layers added. A model has one depth axis per repeated stack whose
length a config key sets:

- the main stack (a decoder, an encoder) and a seq2seq model's decoder, both with the model's
  `layer_period` (Gemma-2's sliding / global pair is one step of 2 layers);
- a multimodal model's tower beside them (a VLM's vision encoder: CLIP, SigLIP, Qwen2.5-VL's windowed
  ViT), with its own key (`vision_config.depth`, `vision_config.num_hidden_layers`). Before these
  axes the tower ran at its full depth in every trace: Qwen2.5-VL-7B's 32 vision blocks were 95% of a
  7B VLM's trace time.

A main stack whose per-layer config lists (`layer_types`, SmolLM3's `no_rope_layers`, or lists its config derives
from a pattern and `build.hf_config` takes as given in a traced copy: Jamba's `layers_block_type`) set its kinds,
with a period of three or more layers (Gemma-3: five sliding-window layers, then a global one), has one axis
per kind instead (`generic.layer_kinds`): two periods were 12 layers and three 18, where two of each kind are 4
and a grown one 5. The traced order keeps one layer of each kind at each end, the real first and last layers'
kinds outermost, and grows in the middle (`_main_order`), so the region classes keep one layer of each kind at
each end (`region_period`). The counts of each kind are exact where a fractional period was not (34 layers are
five periods and four); what is approximate is a class's neighbours: the real stack's last global layer has
four sliding ones after it, the traced copy's one, and the layers added before it stand for all. Where a global
layer's backward holds the peak (tiny Gemma-3 stacks with eager attention and checkpointing), that over-reads a
full-depth trace by those layers' checkpoints: +1.0-1.5% at width 256; on Gemma-3-4B's real shapes the peak
was the same (docs/benchmarks.md, section 15).

A tower whose layers come in two kinds named by an index list (Qwen2.5-VL's `fullatt_block_indexes`: full
attention in blocks 7, 15, 23 and 31, windowed attention in the other 28) has two axes, one per kind,
each extrapolated layer by layer from two layers of its kind to three: four or five traced blocks stand
for 32. The bytes are linear in each kind's count (each layer saves its own activations, and a layer's
transients do not depend on how many came before), and the traced order keeps the real first and last
layers' kinds, which decide the first / last layer regions extrapolation reads.
"""

from __future__ import annotations

from dataclasses import dataclass

from hf_memfit.models.layer_order import distinct as _distinct
from hf_memfit.models.layer_order import kinds as _kinds
from hf_memfit.models.layer_order import main_order as _main_order
from hf_memfit.models.layer_order import write_order


@dataclass(frozen=True)
class DepthPlan:
    """What to trace: `depth_sets[0]` is the base; each later set grows one axis, whose added bytes times its
    entry in `steps` are what the real depth adds (`steps` is aligned with `depth_sets[1:]`)."""

    real: tuple[int, ...]
    depth_sets: list[tuple[int, ...]]
    steps: list[float]

    @property
    def reduced(self) -> bool:
        return len(self.depth_sets) > 1 or self.depth_sets[0] != self.real


def main_kinds(spec) -> dict[str, list] | None:
    """The main stack's per-layer config lists where it is traced by kinds (`generic.layer_kinds`), else None."""
    return (getattr(spec, "generic", None) or {}).get("layer_kinds")


def region_period(spec) -> int:
    """The layers at each end of the main stack that stand for the real stack's (`estimator/regions.py`): one
    period, or by kinds one layer of each kind (the traced order keeps one of each at both ends)."""
    lists = main_kinds(spec)
    return len(_distinct(_kinds(lists))) if lists else getattr(spec, "layer_period", 1) or 1


def _axes(spec) -> list[tuple[int, int]]:
    """(real count, period) per depth axis, main stacks first."""
    period = getattr(spec, "layer_period", 1) or 1
    lists = main_kinds(spec)
    if lists:  # one axis per kind, in the order the real stack first has them
        kinds = _kinds(lists)
        axes = [(kinds.count(kind), 1) for kind in _distinct(kinds)]
    else:
        axes = [(spec.num_layers, period)]
    if spec.is_encoder_decoder and getattr(spec, "num_decoder_layers", 0):
        axes.append((spec.num_decoder_layers, period))
    for tower in towers(spec):
        if _by_kinds(spec, tower):
            specials = len(tower["special"])
            axes += [(tower["depth"] - specials, 1), (specials, 1)]
        elif tower["special"] is None:
            axes.append((tower["depth"], tower["period"]))
        else:
            axes.append((tower["depth"], tower["depth"]))  # whole
    return axes


def _by_kinds(spec, tower: dict) -> bool:
    """Whether a tower has one axis per kind of layer. Only beside a period-1 main stack: the region classes
    keep a main-stack period of layers at each end (`estimator/regions.py`), and in a by-kinds tower those
    would not be one kind at every traced depth."""
    return tower["special"] is not None and region_period(spec) == 1


def towers(spec) -> list[dict]:
    """The generic facts' towers: {key, depth, period, index_key, special} (`generic._tower_axes`)."""
    generic = getattr(spec, "generic", None) or {}
    return list(generic.get("towers", ()))


def real_depths(spec) -> tuple[int, ...]:
    return tuple(count for count, _ in _axes(spec))


def depth_plan(spec, extrapolate: bool = True) -> DepthPlan:
    """The base depths (two periods of each axis) and one grown set (three periods) per axis deeper than its
    base; every axis at its real depth where none is deeper than three periods (or `extrapolate` is off).

    The first layer of a stack can differ from the rest (T5's relative position bias lives in layer 0),
    so an axis is extrapolated from 2p to 3p layers, where the first and the last layer are distinct and
    only ordinary layers are added.

    Axes that grow by the same number of periods share one grown set. The real depth is the base plus each
    step times what its grown set adds, and a period's bytes add to the step's whatever the other axes' depths
    (the linear model every extrapolation here rests on), so one trace growing both axes adds the sum of what
    two traces would: Qwen2.5-VL's language model and the window blocks of its vision tower (28 and 28 layers)
    take 3 traces where they took 4, and Whisper's encoder and decoder 2 where they took 3, with the same fits
    (`benchmarks/trace_identity.py`)."""
    axes = _axes(spec)
    real = tuple(count for count, _ in axes)
    if not extrapolate or all(count <= 3 * period for count, period in axes):
        return DepthPlan(real, [real], [])
    base = tuple(min(2 * period, count) for count, period in axes)
    depth_sets, steps = [base], []
    for i, (count, period) in enumerate(axes):
        if count > base[i]:
            step = (count - base[i]) / period
            if step not in steps:
                depth_sets.append(base)
                steps.append(step)
            at = steps.index(step) + 1
            depth_sets[at] = depth_sets[at][:i] + (3 * period,) + depth_sets[at][i + 1:]
    return DepthPlan(real, depth_sets, steps)


def config_with_depths(spec, depths: tuple[int, ...]) -> dict:
    """The model's config with each depth axis set to `depths` (as `real_depths` orders them)."""
    from hf_memfit.models.spec import _set_path

    lists = main_kinds(spec)
    if lists:
        kinds = _kinds(lists)
        distinct = _distinct(kinds)
        counts = depths[:len(distinct)]
        config = spec.with_layers(sum(counts))
        if list(counts) != [kinds.count(kind) for kind in distinct]:  # else the real stack, as configured
            write_order(config, spec.layer_count_keys[0], lists, _main_order(kinds, dict(zip(distinct, counts))))
        at = len(distinct)
    else:
        main = 2 if spec.is_encoder_decoder and getattr(spec, "num_decoder_layers", 0) else 1
        config = spec.with_layers(depths[0])
        for key, depth in zip(spec.layer_count_keys, depths[:main]):
            _set_path(config, key, depth)
        at = main
    for tower in towers(spec):
        holder = _holder(config, tower["key"])
        *_, depth_key = tower["key"].split(".")
        if not _by_kinds(spec, tower):
            holder[depth_key] = depths[at]
            at += 1
            continue
        ordinary, special = depths[at], depths[at + 1]
        at += 2
        if ordinary + special == tower["depth"] and special == len(tower["special"]):
            continue  # the real tower, as configured
        kinds = _kinds_at(tower["depth"], tower["special"], ordinary, special)
        holder[depth_key] = len(kinds)
        holder[tower["index_key"]] = [i for i, is_special in enumerate(kinds) if is_special]
    return config


def _holder(config: dict, dotted: str) -> dict:
    *parents, _ = dotted.split(".")
    for part in parents:
        config = config[part]
    return config


def _kinds_at(depth: int, special: list[int], ordinary_count: int, special_count: int) -> list[bool]:
    """A layer order with these counts of each kind (two or more each), whose first and last layers are of the
    real tower's kinds: two of each, [O, S, O, S] (or [O, S, S, O] where the real tower starts and ends with
    one kind), and a kind grown by repeating its first layer: [O, O, S, O, S] or [O, S, S, O, S]."""
    real = [i in set(special) for i in range(depth)]
    first, last = real[0], real[-1]
    kinds = [first, not first, first, not first] if first != last else [first, not first, not first, first]
    for kind, wanted in ((False, ordinary_count), (True, special_count)):
        while sum(k == kind for k in kinds) < wanted:
            kinds.insert(kinds.index(kind) + 1, kind)
    return kinds
