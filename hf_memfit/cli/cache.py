"""`hf-memfit cache info | warm | clear`: the on-disk cache of generic model facts and fast-mode calibrations."""

import argparse
import time

from hf_memfit.cli.output import emit
from hf_memfit.errors import MemFitError
from hf_memfit.estimator.worker_pool import keeps_workers

CACHE_EPILOG = """examples:
  hf-memfit cache info
  hf-memfit cache warm                          # every catalogue model without hand-written formulas
  hf-memfit cache warm Qwen/Qwen3-8B-Base ./my-model/config.json
  HF_MEMFIT_CACHE=/opt/hf_memfit hf-memfit cache warm   # e.g. while building a Docker image
  hf-memfit cache clear
"""


# What `hf-memfit cache warm` calibrates for each model: the settings users plan most (full fine-tuning,
# LoRA and QLoRA, each with and without checkpointing, bf16 mixed precision on a bf16 GPU with flash
# attention); one fit then serves every micro-batch, sequence length, accumulation, AdamW-family optimizer
# and layout of its setting (`estimator/parametric.py`).
WARM_SETTINGS = tuple(
    {"precision": "bf16-mixed", "gpu": "H100", "gradient_checkpointing": checkpointing, **adapters}
    for adapters in ({}, {"lora_r": 16}, {"lora_r": 16, "load_in_4bit": True})
    for checkpointing in (True, False)
)


@keeps_workers  # its fits trace on workers whose caches stay warm from one fit to the next
def warm_model(spec, seq_len: int = 2048) -> tuple[int, dict[str, list[str]]]:
    """Calibrate `spec` for `WARM_SETTINGS` now: (how many calibrations were made (0: all cached), the settings
    left out by the one-line reason they do not validate for this model).

    An image or audio model is calibrated at its inputs' default shape (its sequence is not `seq_len`), and
    not at all where that shape must be given (CTC's `--audio-seconds`); a setting the model cannot take
    (LoRA where peft has no default targets for its type) is left out, as its plan would refuse it.
    """
    from hf_memfit.cache import cache_entries
    from hf_memfit.estimator.assemble import prepare, step_memory, traced_settings
    from hf_memfit.settings import TrainSettings
    from hf_memfit.tasks import FIXED_SEQUENCE_TASKS

    before = sum(cache_entries().values())
    if spec.default_task in FIXED_SEQUENCE_TASKS:
        seq_len = None  # made from the inputs (`models/inputs.resolve_inputs`)
    else:
        seq_len = min(seq_len, spec.max_position_embeddings or seq_len)
    wanted, left_out = [], {}
    for fields in WARM_SETTINGS:
        try:
            wanted.append(TrainSettings(batch_size=1, seq_len=seq_len, **fields).validate(spec))
        except MemFitError as refused:  # with and without checkpointing alike: each fine-tune once
            labels = left_out.setdefault(str(refused), [])
            if _label(fields) not in labels:
                labels.append(_label(fields))
    prepare(spec, wanted)  # side by side where CPUs are idle
    for settings in wanted:  # what `prepare` does not make (hand-written families' facts) is made here
        step_memory(spec, traced_settings(settings))
    return sum(cache_entries().values()) - before, left_out


def _label(fields: dict) -> str:
    """A `WARM_SETTINGS` entry's fine-tune in words (full, LoRA or QLoRA)."""
    return "QLoRA" if fields.get("load_in_4bit") else "LoRA" if fields.get("lora_r") else "full"


def add_cache_parser(sub) -> None:
    parser = sub.add_parser("cache", help="show, pre-build or clear the calibration cache", epilog=CACHE_EPILOG,
                            formatter_class=argparse.RawDescriptionHelpFormatter)
    actions = parser.add_subparsers(dest="action", required=True, parser_class=type(parser))
    info = actions.add_parser("info", help="where the cache is and what it holds")
    info.set_defaults(func=cmd_cache_info)
    warm = actions.add_parser("warm", help="calibrate fast mode now, so later plans start warm")
    warm.add_argument("models", nargs="*", metavar="MODEL",
                      help="catalogue names, Hub ids or config.json paths (default: every catalogue model that "
                           "has no hand-written formulas, i.e. the ones fast mode calibrates)")
    warm.set_defaults(func=cmd_cache_warm)
    clear = actions.add_parser("clear", help="delete every cached entry")
    clear.set_defaults(func=cmd_cache_clear)


def cmd_cache_info(args: argparse.Namespace) -> int:
    from hf_memfit.cache import CACHE_VERSION, cache_dir, cache_entries, code_version, library_versions

    entries = cache_entries()
    emit(f"cache: {cache_dir()} (set HF_MEMFIT_CACHE to move it)")
    emit(f"entries: {', '.join(f'{kind} {count}' for kind, count in entries.items()) or 'none'}")
    emit(f"valid for: hf-memfit code {code_version()} (format {CACHE_VERSION}), "
          + ", ".join(f"{name} {version}" for name, version in library_versions().items()))
    return 0


def cmd_cache_clear(args: argparse.Namespace) -> int:
    from hf_memfit.cache import cache_dir, clear_cache

    emit(f"removed {clear_cache()} file(s) from {cache_dir()}")
    return 0


def cmd_cache_warm(args: argparse.Namespace) -> int:
    from hf_memfit.models.spec import catalogue_names, resolve_model

    names = args.models or [name for name in catalogue_names() if not resolve_model(name).hand_written]
    specs = [resolve_model(name) for name in names]  # every name checked before any work starts
    started = time.perf_counter()
    for number, spec in enumerate(specs, 1):
        if spec.hand_written:
            emit(f"[{number}/{len(specs)}] {spec.name}: hand-written formulas, nothing to calibrate")
            continue
        t0 = time.perf_counter()
        made, left_out = warm_model(spec)
        emit(f"[{number}/{len(specs)}] {spec.name}: {made} calibration(s) made in {time.perf_counter() - t0:.1f} s")
        for reason, labels in left_out.items():  # its first plan of these makes their fits
            emit(f"    not warmed for {' / '.join(labels)} fine-tunes: {reason}")
    emit(f"done in {time.perf_counter() - started:.1f} s")
    if not specs:
        raise MemFitError("nothing to warm: the catalogue has no model without hand-written formulas")
    return 0
