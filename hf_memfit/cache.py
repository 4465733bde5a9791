"""The on-disk cache of what hf-memfit learns by tracing: generic model facts and fast-mode calibrations.

An entry is trusted only if everything it was computed from is unchanged:
- its key hashes the model config, the versions of the libraries a trace runs
  (`library_versions()`: torch, transformers, peft, bitsandbytes, torchao, TRL),
  hf-memfit's own code (`code_version()`: a hash of the modules whose output is
  cached) and whatever else the caller passes;
- the file holds its key, its kind and a SHA-256 of its value, and a read that
  finds a truncated, edited or foreign file returns None, so the caller
  recomputes the value and overwrites the entry;
- writes go to a private temporary file and `os.replace` it into place, so two
  processes calibrating at once never see half a file (the last writer wins,
  with the same value).

`$HF_MEMFIT_CACHE` moves the cache (default `~/.cache/hf_memfit`);
`hf-memfit cache warm` fills it for the catalogue, `hf-memfit cache clear` empties it.
Nothing here imports torch or transformers: the fast path reads the cache in milliseconds.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import re
from functools import lru_cache
from pathlib import Path
from typing import Any

#: Bumped whenever what is cached changes meaning in a way the code hash would not show.
CACHE_VERSION = 3

# The libraries whose behaviour a trace records. Their versions are read from their sources, not by
# importing them: importing transformers or torch (or importlib.metadata) would cost the cached fast
# path most of its time budget.
TRACED_LIBRARIES = ("torch", "transformers", "peft", "bitsandbytes", "torchao", "trl")

# hf-memfit's modules whose output is cached: the model facts (models/), the traces and the fits built
# on them (estimator/), and the settings and optimizer tables they read.
_CODE_FOLDERS = ("models", "estimator")
_CODE_FILES = ("settings.py", "optimizers.py", "hardware.py", "cache.py")


def cache_dir() -> Path:
    """Where calibrations and generic model facts are kept: `$HF_MEMFIT_CACHE`, else ~/.cache/hf_memfit."""
    root = os.environ.get("HF_MEMFIT_CACHE")
    if root:
        return Path(root).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "hf_memfit"


@lru_cache(maxsize=None)
def library_version(name: str) -> str:
    """A library's version, read from its `__init__.py` or `version.py` without importing it."""
    found = importlib.util.find_spec(name)
    if found is None or not found.origin:
        return "not installed"
    folder = Path(found.origin).parent
    for source in (folder / "version.py", folder / "_version.py", Path(found.origin)):
        try:
            head = source.read_text(encoding="utf-8")[:20000]
        except OSError:
            continue
        match = re.search(r"""^__version__\s*(?::\s*str\s*)?=\s*["']([^"']+)["']""", head, re.MULTILINE)
        if match:
            return match.group(1)
    for metadata in folder.parent.glob(f"{name}-*.dist-info/METADATA"):  # set by the build, not in the source
        match = re.search(r"^Version: (\S+)", metadata.read_text(encoding="utf-8")[:2000], re.MULTILINE)
        if match:
            return match.group(1)
    return "unknown"


def library_versions() -> dict[str, str]:
    return {name: library_version(name) for name in TRACED_LIBRARIES}


@lru_cache(maxsize=1)
def code_version() -> str:
    """A hash of the hf-memfit sources whose output is cached: any edit to them invalidates every entry."""
    package = Path(__file__).parent
    digest = hashlib.sha256()
    files = [package / name for name in _CODE_FILES]
    for folder in _CODE_FOLDERS:
        files += sorted((package / folder).rglob("*.py"))
    for path in files:
        digest.update(path.relative_to(package).as_posix().encode())
        digest.update(path.read_bytes())
    return digest.hexdigest()[:16]


def config_key(config: dict, *extra: Any) -> str:
    """A stable hash of a config and of everything else the cached value depends on."""
    text = json.dumps([config, library_versions(), code_version(), CACHE_VERSION, *extra], sort_keys=True,
                      default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:24]


def _checksum(value: dict) -> str:
    return hashlib.sha256(json.dumps(value, sort_keys=True).encode()).hexdigest()


def entry_path(kind: str, key: str) -> Path:
    return cache_dir() / kind / f"{key}.json"


def read_cache(kind: str, key: str) -> dict | None:
    """A cached value, or None when it is missing, unreadable, or fails its checks (the caller recomputes it)."""
    try:
        entry = json.loads(entry_path(kind, key).read_text(encoding="utf-8"))
        value = entry["value"]
        if entry.get("kind") != kind or entry.get("key") != key or entry.get("sha256") != _checksum(value):
            return None
    except (OSError, ValueError, TypeError, KeyError):
        return None
    return value if isinstance(value, dict) else None


def write_cache(kind: str, key: str, value: dict) -> None:
    """Store a value atomically with its key and checksum; a cache that cannot be written is skipped, never fatal."""
    folder = cache_dir() / kind
    entry = {"kind": kind, "key": key, "sha256": _checksum(value), "versions": library_versions(),
             "code": code_version(), "value": value}
    tmp = folder / f".{key}.{os.getpid()}.{id(value)}.tmp"
    try:
        folder.mkdir(parents=True, exist_ok=True)
        tmp.write_text(json.dumps(entry, sort_keys=True), encoding="utf-8")
        os.replace(tmp, folder / f"{key}.json")
    except OSError:
        tmp.unlink(missing_ok=True)


def cache_entries() -> dict[str, int]:
    """kind -> how many entries the cache holds."""
    root = cache_dir()
    if not root.is_dir():
        return {}
    return {folder.name: sum(1 for _ in folder.glob("*.json")) for folder in sorted(root.iterdir()) if folder.is_dir()}


def clear_cache() -> int:
    """Delete every entry (and stray temporary file); returns how many files were removed."""
    removed = 0
    root = cache_dir()
    if not root.is_dir():
        return 0
    for folder in root.iterdir():
        if not folder.is_dir():
            continue
        for path in list(folder.glob("*.json")) + list(folder.glob(".*.tmp")):
            path.unlink(missing_ok=True)
            removed += 1
    return removed
