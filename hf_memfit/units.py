"""Byte sizes: parse what users type ("12GiB", "24GB", "1.5e9") and print them back."""

import re

from hf_memfit.errors import MemFitError

KiB, MiB, GiB, TiB = 1024, 1024**2, 1024**3, 1024**4
_UNITS = {
    "": 1, "b": 1,
    "k": 1000, "kb": 1000, "kib": KiB,
    "m": 1000**2, "mb": 1000**2, "mib": MiB,
    "g": 1000**3, "gb": 1000**3, "gib": GiB,
    "t": 1000**4, "tb": 1000**4, "tib": TiB,
}
# The largest memory size any budget may name, per GPU or per node. No device comes near it: the largest
# GPU has 288 GB of HBM (AMD MI355X / NVIDIA B300) and the largest single-system-image hosts hold 64 TiB
# (HPE Superdome Flex at its maximum configuration, SGI UV 3000). A size beyond it is a typo ("1e30GiB",
# "80TiB" for "80GiB") and would make every plan fit, so it is refused rather than planned for.
MAX_MEMORY_BYTES = 64 * TiB
_SIZE_RE = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:e[+-]?[0-9]+)?)\s*([a-z]*)\s*$", re.IGNORECASE)


def parse_bytes(text: str | int | float, what: str = "size") -> int:
    """Parse "12GiB", "24 GB", "80g" or a plain number of bytes. `what` names the argument in errors.

    Every size parsed here is a memory size (a GPU budget, a node's RAM), so anything over
    `MAX_MEMORY_BYTES` is refused here, once, for every flag and API field that takes one.
    """
    if isinstance(text, (int, float)) and not isinstance(text, bool):
        value, unit = float(text), ""
    else:
        match = _SIZE_RE.match(str(text))
        if not match or match.group(2).lower() not in _UNITS:
            raise MemFitError(f"`{what}` got {text!r}; give a size such as 12GiB, 24GB or 80e9")
        value, unit = float(match.group(1)), match.group(2).lower()
    scaled = value * _UNITS[unit]
    if not scaled <= MAX_MEMORY_BYTES:  # also "1e400GiB" (float() reads inf; int(inf) raises) and a NaN
        raise MemFitError(f"`{what}` got {text!r}, more than any device holds (the limit is "
                          f"{format_bytes(MAX_MEMORY_BYTES)} per GPU or node); give the real size, e.g. 80GiB")
    size = int(scaled)
    if size <= 0:
        raise MemFitError(f"`{what}` must be positive, got {text!r}")
    if not unit and size < KiB:  # "12" or "80" meant as GiB: no memory budget is a few hundred bytes
        raise MemFitError(f"`{what}` got {text!r}, which is {size} bytes; did you mean {text}GiB? "
                          "(give a unit: 12GiB, 24GB)")
    return size


def format_bytes(n: int | float) -> str:
    """1234567890 -> '1.15 GiB'. Binary units, because that is what nvidia-smi's MiB and torch use."""
    n = float(n)
    sign = "-" if n < 0 else ""
    n = abs(n)
    for unit, scale in (("TiB", TiB), ("GiB", GiB), ("MiB", MiB), ("KiB", KiB)):
        if n >= scale:
            return f"{sign}{n / scale:.2f} {unit}"
    return f"{sign}{int(n)} B"


def format_count(n: int) -> str:
    """A parameter count: 8030261248 -> '8.03B', 276480 -> '0.3M', 1234 -> '1,234'."""
    return f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.1f}M" if n >= 1e5 else f"{n:,}"


# CUDACachingAllocator rounds every request up to a multiple of kMinBlockSize, at least one block
# ("all sizes are rounded to at least 512 bytes", c10/cuda/CUDACachingAllocator.cpp).
CUDA_BLOCK_BYTES = 512


def cuda_block_bytes(nbytes: int) -> int:
    """The bytes the CUDA caching allocator hands out for a request of `nbytes`."""
    return max(CUDA_BLOCK_BYTES, -(-nbytes // CUDA_BLOCK_BYTES) * CUDA_BLOCK_BYTES)
