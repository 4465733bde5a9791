"""`hf-memfit cache info | warm | clear`: the on-disk cache of generic model facts and fast-mode calibrations."""

import argparse
import time

from hf_memfit.errors import MemFitError

CACHE_EPILOG = """examples:
  hf-memfit cache info
  hf-memfit cache warm                          # every catalogue model without hand-written formulas
  hf-memfit cache warm Qwen/Qwen3-8B-Base ./my-model/config.json
  HF_MEMFIT_CACHE=/opt/hf_memfit hf-memfit cache warm   # e.g. while building a Docker image
  hf-memfit cache clear
"""


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
    print(f"cache: {cache_dir()} (set HF_MEMFIT_CACHE to move it)")
    print(f"entries: {', '.join(f'{kind} {count}' for kind, count in entries.items()) or 'none'}")
    print(f"valid for: hf-memfit code {code_version()} (format {CACHE_VERSION}), "
          + ", ".join(f"{name} {version}" for name, version in library_versions().items()))
    return 0


def cmd_cache_clear(args: argparse.Namespace) -> int:
    from hf_memfit.cache import cache_dir, clear_cache

    print(f"removed {clear_cache()} file(s) from {cache_dir()}")
    return 0


def cmd_cache_warm(args: argparse.Namespace) -> int:
    from hf_memfit.estimator.calibrated import warm
    from hf_memfit.models.spec import catalogue_names, resolve_model

    names = args.models or [name for name in catalogue_names() if not resolve_model(name).hand_written]
    specs = [resolve_model(name) for name in names]  # every name checked before any work starts
    started = time.perf_counter()
    for number, spec in enumerate(specs, 1):
        if spec.hand_written:
            print(f"[{number}/{len(specs)}] {spec.name}: hand-written formulas, nothing to calibrate")
            continue
        t0 = time.perf_counter()
        made = warm(spec)
        print(f"[{number}/{len(specs)}] {spec.name}: {made} calibration(s) made in {time.perf_counter() - t0:.1f} s",
              flush=True)
    print(f"done in {time.perf_counter() - started:.1f} s")
    if not specs:
        raise MemFitError("nothing to warm: the catalogue has no model without hand-written formulas")
    return 0
