"""The GPU table, as data: memory, compute capability, peak throughput, links.

`memory_bytes` is what `torch.cuda.get_device_properties(i).total_memory` reports
(cudaDeviceProp.totalGlobalMem), not the marketing size: an "80GB" A100 shows
79.15 GiB, a "16GB" T4 about 14.6 GiB. The driver keeps the rest (ECC, page
tables, its own reservations), and the figure drifts by a few hundred MiB with
the driver version. Each row takes the value printed by torch in public logs
(`_CudaDeviceProperties(... total_memory=NNNNNMB)` or the OOM message's "total
capacity of X GiB"), preferring recent drivers and the lower figure when they
disagree, since predicting a fit that fails costs more than the reverse. The
CUDA context (see `cuda_overhead.cuda_context_bytes`) comes out of this total.

Throughputs are dense (no 2:4 sparsity), from the vendor datasheet or
whitepaper named in each row's `source`. `fp16_tflops` is the tensor-core rate
for fp16/bf16 inputs with fp32 accumulation, which is what training matmuls use;
GeForce cards run that at half their fp16-accumulate rate, so their figures are
half the headline number. Cards without TF32 (compute capability < 8.0) list
their fp32 rate as `tf32_tflops`, because torch falls back to plain fp32 there.

Nothing here imports torch at module level: the CLI's fast path stays torch-free.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass

from hf_memfit.errors import MemFitError
from hf_memfit.units import MiB

_GB = 1e9  # vendors quote bandwidth in decimal GB/s
_TB = 1e12

# Effective unidirectional host-to-device bandwidth of an x16 link with pinned
# memory: roughly 75-80% of the raw rate (gen3 15.8, gen4 31.5, gen5 63 GB/s)
# once packet and protocol overhead are paid. These are round planning figures,
# not measurements made here.
PCIE_GEN3_X16 = 12 * _GB
PCIE_GEN4_X16 = 25 * _GB
PCIE_GEN5_X16 = 50 * _GB


@dataclass(frozen=True)
class GPU:
    """One GPU model. Sizes in bytes, rates in bytes/s and TFLOP/s (dense)."""

    name: str
    # Usable total as torch reports it (totalGlobalMem), not the marketing GB.
    memory_bytes: int
    compute_capability: tuple[int, int]
    supports_bf16: bool  # native bf16 math: sm80 (Ampere) and newer
    supports_flash_attention: bool  # SDPA's flash backend needs sm80+
    fp32_tflops: float  # CUDA-core fp32
    tf32_tflops: float  # tensor-core tf32; equals fp32_tflops where there is no TF32
    fp16_tflops: float  # tensor-core fp16/bf16 with fp32 accumulation
    hbm_bandwidth_bytes_per_s: float  # device memory bandwidth (HBM or GDDR)
    pcie_bandwidth_bytes_per_s: float  # effective unidirectional host link
    # Unidirectional NVLink bandwidth per GPU: half the vendor's bidirectional
    # total (e.g. A100 "600 GB/s" -> 300e9). 0 when the part has no NVLink.
    nvlink_bandwidth_bytes_per_s: float
    source: str = ""
    # Streaming multiprocessors and the resident threads each holds: CUDA's reduction kernel sizes the block it
    # stages partial sums in from them (`estimator/reduction_staging.py`). 0: not known.
    sm_count: int = 0
    max_threads_per_sm: int = 0

    def matmul_tflops(self, dtype: str) -> float:
        """Peak dense matmul TFLOP/s for "fp32", "tf32", "fp16" or "bf16" (0 if unsupported)."""
        rates = {
            "fp32": self.fp32_tflops, "float32": self.fp32_tflops,
            "tf32": self.tf32_tflops,
            "fp16": self.fp16_tflops, "float16": self.fp16_tflops, "half": self.fp16_tflops,
            "bf16": self.fp16_tflops if self.supports_bf16 else 0.0,
        }
        rates["bfloat16"] = rates["bf16"]
        if dtype.lower() not in rates:
            raise MemFitError(f"`dtype` got {dtype!r}; use one of fp32, tf32, fp16, bf16")
        return rates[dtype.lower()]


# Maximum resident threads per SM by compute capability: the CUDA C++ Programming Guide's table of technical
# specifications per compute capability ("Maximum number of resident threads per SM").
MAX_THREADS_PER_SM = {(7, 0): 2048, (7, 5): 1024, (8, 0): 2048, (8, 6): 1536, (8, 9): 1536, (9, 0): 2048}


def _gpu(name: str, mib: int, cc: tuple[int, int], fp32: float, tf32: float, fp16: float,
         mem_bw: float, pcie: float, nvlink: float, source: str, *, sms: int) -> GPU:
    ampere_plus = cc >= (8, 0)
    return GPU(name=name, memory_bytes=mib * MiB, compute_capability=cc,
               supports_bf16=ampere_plus, supports_flash_attention=ampere_plus,
               fp32_tflops=fp32, tf32_tflops=tf32, fp16_tflops=fp16,
               hbm_bandwidth_bytes_per_s=mem_bw, pcie_bandwidth_bytes_per_s=pcie,
               nvlink_bandwidth_bytes_per_s=nvlink, source=source, sm_count=sms,
               max_threads_per_sm=MAX_THREADS_PER_SM[cc])


# name, total_memory in MiB (torch), cc, fp32, tf32, fp16/bf16 (TFLOP/s dense),
# memory bandwidth, host link, NVLink (unidirectional), source; SMs from NVIDIA's architecture whitepapers and
# datasheets (CUDA cores / 64 for T4, V100 and A100, / 128 for the rest), matching the `multi_processor_count` torch
# reports where public (T4 40, V100 80, A10G 80, A100 108, L40S 142, RTX 3060 28, RTX 3090 82, RTX 4090 128, H100
# SXM 132, H100 PCIe 114); H200's 132 as the 2026-11-27 H200 session read it.
GPUS: tuple[GPU, ...] = (
    # total_memory=14930MB (torch 2.x on a 2025 driver; older drivers 15079-15109MB);
    # OOM messages show 14.56-14.58 GiB on current drivers.
    _gpu("T4", 14_930, (7, 5), 8.1, 8.1, 65.0, 320 * _GB, PCIE_GEN3_X16, 0,
         "NVIDIA T4 Tensor Core GPU datasheet (FP16 mixed precision 65 TFLOPS)", sms=40),
    # total_memory=16160MB for Tesla V100-SXM2-16GB. Figures are for SXM2; the PCIe
    # card is 14 / 112 TFLOPS and has no NVLink.
    _gpu("V100-16GB", 16_160, (7, 0), 15.7, 15.7, 125.0, 900 * _GB, PCIE_GEN3_X16, 150 * _GB,
         "NVIDIA V100 Tensor Core GPU datasheet (SXM2; NVLink 300 GB/s bidirectional)", sms=80),
    # OOM messages show 31.74-31.75 GiB total capacity.
    _gpu("V100-32GB", 32_510, (7, 0), 15.7, 15.7, 125.0, 900 * _GB, PCIE_GEN3_X16, 150 * _GB,
         "NVIDIA V100 Tensor Core GPU datasheet (SXM2; NVLink 300 GB/s bidirectional)", sms=80),
    # AWS g5 part (GA102, 80 SMs). NVIDIA publishes no A10G datasheet; the rates are
    # the A10 datasheet's, which AWS-facing docs repeat. OOMs show 21.98 GiB
    # (torch total_memory=22587MB on another driver).
    _gpu("A10G", 22_507, (8, 6), 31.2, 62.5, 125.0, 600 * _GB, PCIE_GEN4_X16, 0,
         "NVIDIA A10 Tensor Core GPU datasheet (A10G is AWS's variant; no separate datasheet)", sms=80),
    # OOMs in vLLM's L4 CI show 22.05 GiB total capacity.
    _gpu("L4", 22_579, (8, 9), 30.3, 60.0, 121.0, 300 * _GB, PCIE_GEN4_X16, 0,
         "NVIDIA L4 Tensor Core GPU datasheet (TF32 120 / FP16 242 TFLOPS with sparsity, halved)", sms=58),
    # total_memory=45589MB.
    _gpu("L40S", 45_589, (8, 9), 91.6, 183.0, 362.0, 864 * _GB, PCIE_GEN4_X16, 0,
         "NVIDIA L40S GPU datasheet (BF16 362.05 / TF32 183 TFLOPS dense)", sms=142),
    # OOMs show 39.50 GiB on current drivers (paddle docs print total_memory=40536MB).
    _gpu("A100-40GB", 40_448, (8, 0), 19.5, 156.0, 312.0, 1555 * _GB, PCIE_GEN4_X16, 300 * _GB,
         "NVIDIA A100 Tensor Core GPU datasheet (SXM4 40GB; NVLink 600 GB/s bidirectional)", sms=108),
    # OOMs show 79.15 GiB total capacity (the most common A100 80GB figure).
    _gpu("A100-80GB", 81_050, (8, 0), 19.5, 156.0, 312.0, 2039 * _GB, PCIE_GEN4_X16, 300 * _GB,
         "NVIDIA A100 Tensor Core GPU datasheet (SXM4 80GB; PCIe 80GB has 1935 GB/s, no NVLink)", sms=108),
    # total_memory=81082-81090MB for "NVIDIA H100 80GB HBM3" across torch 2.0-2.7 logs.
    _gpu("H100-80GB", 81_089, (9, 0), 67.0, 494.5, 989.5, 3.35 * _TB, PCIE_GEN5_X16, 450 * _GB,
         "NVIDIA H100 Tensor Core GPU datasheet (SXM5; BF16 1979 / TF32 989 with sparsity, halved; "
         "NVLink 900 GB/s bidirectional)", sms=132),
    # total_memory=81008MB. NVLink exists only with an optional pairwise bridge: 0 here.
    _gpu("H100-PCIe", 81_008, (9, 0), 51.0, 378.0, 756.0, 2.0 * _TB, PCIE_GEN5_X16, 0,
         "NVIDIA H100 Tensor Core GPU datasheet (PCIe; BF16 1513 / TF32 756 with sparsity, halved)", sms=114),
    # total_memory=143156MB; OOMs show 139.80-139.81 GiB.
    _gpu("H200", 143_156, (9, 0), 67.0, 494.5, 989.5, 4.8 * _TB, PCIE_GEN5_X16, 450 * _GB,
         "NVIDIA H200 Tensor Core GPU datasheet (SXM; same compute as H100 SXM, 4.8 TB/s HBM3e)", sms=132),
    # total_memory 11931-12044MB across logs; 11938MB is typical on Linux.
    # GA106: 28 SMs x 512 fp16 FMA-with-fp32-accumulate FLOP/clk x 1.777 GHz = 25.5 TFLOPS.
    _gpu("RTX3060-12GB", 11_938, (8, 6), 12.7, 12.7, 25.5, 360 * _GB, PCIE_GEN4_X16, 0,
         "NVIDIA GeForce RTX 3060 specs; rates derived as for GA102 in the Ampere GA102 whitepaper", sms=28),
    # total_memory=24259-24268MB; OOMs show 23.69 GiB.
    _gpu("RTX3090", 24_259, (8, 6), 35.6, 35.6, 71.0, 936 * _GB, PCIE_GEN4_X16, 56.25 * _GB,
         "NVIDIA Ampere GA102 GPU architecture whitepaper, appendix A (RTX 3090: FP16 with FP32 "
         "accumulate 71 TFLOPS dense; NVLink bridge 112.5 GB/s bidirectional)", sms=82),
    # OOMs on Linux servers show 23.64-23.65 GiB (one log prints total_memory=24563MB).
    _gpu("RTX4090", 24_217, (8, 9), 82.6, 82.6, 165.2, 1008 * _GB, PCIE_GEN4_X16, 0,
         "NVIDIA Ada Lovelace GPU architecture whitepaper (RTX 4090: FP16/BF16 with FP32 "
         "accumulate 165.2 TFLOPS dense)", sms=128),
    # total_memory=48676MB. 84 SMs x 1024 FLOP/clk x 1.8 GHz = 154.8 TFLOPS dense.
    _gpu("A6000", 48_676, (8, 6), 38.7, 77.4, 154.8, 768 * _GB, PCIE_GEN4_X16, 56.25 * _GB,
         "NVIDIA RTX A6000 datasheet (tensor 309.7 TFLOPS with sparsity, halved; NVLink bridge "
         "112.5 GB/s bidirectional)", sms=84),
    # total_memory=48622MB. 142 SMs x 1024 FLOP/clk x 2.505 GHz = 364 TFLOPS dense.
    _gpu("RTX6000-Ada", 48_622, (8, 9), 91.1, 182.1, 364.2, 960 * _GB, PCIE_GEN4_X16, 0,
         "NVIDIA RTX 6000 Ada Generation datasheet (FP8 1457 TFLOPS with sparsity -> FP16 dense 364)", sms=142),
)

_BY_NAME = {gpu.name: gpu for gpu in GPUS}

# Extra spellings, normalized by `_normalize` (lowercase alphanumerics, vendor words
# dropped). Torch device names (`torch.cuda.get_device_name()`) are listed too, so
# `detect_local_gpu` can match a real card. A bare family name means the SKU most
# clouds rent today: "a100" is the 80GB SXM part, "v100" the 16GB one (AWS p3).
_ALIASES: dict[str, str] = {
    "t4": "T4",
    "v100": "V100-16GB", "v10016gb": "V100-16GB", "v10016": "V100-16GB",
    "v100sxm216gb": "V100-16GB", "v100pcie16gb": "V100-16GB",
    "v10032gb": "V100-32GB", "v10032": "V100-32GB", "v100sxm232gb": "V100-32GB",
    "v100pcie32gb": "V100-32GB", "v100s": "V100-32GB", "v100spcie32gb": "V100-32GB",
    # The A10 (72 SMs) has the same memory and datasheet rates as the A10G row (only its SMs differ, 80 on A10G).
    "a10g": "A10G", "a10": "A10G",
    "l4": "L4",
    "l40s": "L40S",
    "a10040gb": "A100-40GB", "a10040": "A100-40GB", "a100sxm440gb": "A100-40GB",
    "a100pcie40gb": "A100-40GB",
    "a100": "A100-80GB", "a10080gb": "A100-80GB", "a10080": "A100-80GB",
    "a100sxm480gb": "A100-80GB", "a10080gbpcie": "A100-80GB", "a100pcie80gb": "A100-80GB",
    "h100": "H100-80GB", "h10080gb": "H100-80GB", "h10080": "H100-80GB", "h100sxm": "H100-80GB",
    "h100sxm5": "H100-80GB", "h100sxm580gb": "H100-80GB", "h10080gbhbm3": "H100-80GB",
    "h100pcie": "H100-PCIe", "h100pcie80gb": "H100-PCIe",
    "h200": "H200", "h200sxm": "H200", "h200141gb": "H200", "h200sxm141gb": "H200",
    "rtx3060": "RTX3060-12GB", "3060": "RTX3060-12GB", "rtx306012gb": "RTX3060-12GB",
    "306012gb": "RTX3060-12GB",
    "rtx3090": "RTX3090", "3090": "RTX3090",
    "rtx4090": "RTX4090", "4090": "RTX4090",
    "a6000": "A6000", "rtxa6000": "A6000",
    "rtx6000ada": "RTX6000-Ada", "6000ada": "RTX6000-Ada", "rtx6000adageneration": "RTX6000-Ada",
}
_ALIASES.update({re.sub(r"[^a-z0-9]", "", gpu.name.lower()): gpu.name for gpu in GPUS})

_VENDOR_WORDS = re.compile(r"\b(nvidia|geforce|tesla|quadro)\b")


def _normalize(name: str) -> str:
    words = re.sub(r"[^a-z0-9]+", " ", name.lower())
    return _VENDOR_WORDS.sub("", words).replace(" ", "")


def find_gpu(name: str) -> GPU:
    """Look a GPU up by name or alias ("a100", "A100-80GB", "a100_80gb", "rtx3060", "4090")."""
    canonical = _ALIASES.get(_normalize(name))
    if canonical is None:
        known = ", ".join(gpu.name for gpu in GPUS)
        raise MemFitError(f"`--gpu` got {name!r}, which is not a known GPU; use one of {known}, "
                          "or give `--gpu-memory` with a size such as 24GiB")
    return _BY_NAME[canonical]


def named_gpu(name: str | None) -> GPU | None:
    """`find_gpu(name)`, or None where no GPU is named (`TrainSettings.gpu` unset: an unknown GPU)."""
    return None if not name else find_gpu(name)


def detect_local_gpu() -> tuple[GPU, int] | None:
    """The local CUDA device 0 and its free memory in bytes, or None without one.

    Imports torch only here, and only if it is installed. A known card comes back
    as its table row with `memory_bytes` replaced by what this driver reports; an
    unknown one is built from the device properties, with throughputs 0 (unknown).
    """
    try:
        import torch  # deferred: importing torch costs seconds, the fast path never does
    except (ImportError, OSError):  # not installed, or its CUDA libraries fail to load
        return None
    if not torch.cuda.is_available():
        return None
    props = torch.cuda.get_device_properties(0)
    free_bytes, _total = torch.cuda.mem_get_info(0)
    cc = (int(props.major), int(props.minor))
    canonical = _ALIASES.get(_normalize(props.name))
    if canonical is not None:
        gpu = dataclasses.replace(_BY_NAME[canonical], memory_bytes=int(props.total_memory))
    else:
        ampere_plus = cc >= (8, 0)
        gpu = GPU(name=props.name, memory_bytes=int(props.total_memory), compute_capability=cc,
                  supports_bf16=ampere_plus, supports_flash_attention=ampere_plus,
                  fp32_tflops=0.0, tf32_tflops=0.0, fp16_tflops=0.0,
                  hbm_bandwidth_bytes_per_s=0.0, pcie_bandwidth_bytes_per_s=0.0,
                  nvlink_bandwidth_bytes_per_s=0.0,
                  source="torch.cuda.get_device_properties (not in the table: throughputs unknown)")
    gpu = dataclasses.replace(gpu, sm_count=int(props.multi_processor_count),
                              max_threads_per_sm=int(getattr(props, "max_threads_per_multi_processor", 0)))
    return gpu, int(free_bytes)


def gpu_memory_auto() -> int:
    """Free memory of the local GPU in bytes, for `--gpu-memory auto`."""
    found = detect_local_gpu()
    if found is None:
        raise MemFitError("`--gpu-memory auto` needs a CUDA GPU, and none was found; "
                          "give a size such as `--gpu-memory 24GiB` or `--gpu NAME`")
    return found[1]


def host_memory_auto() -> int:
    """Total RAM of this machine in bytes (what `--cpu-memory auto` checks host memory against)."""
    import os

    try:
        return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    except (ValueError, OSError, AttributeError):  # not a POSIX system that reports it
        raise MemFitError("`--cpu-memory auto` cannot read this machine's RAM here; "
                          "give a size such as `--cpu-memory 64GiB`, or `--cpu-memory none`") from None
