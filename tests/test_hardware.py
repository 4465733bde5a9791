"""The GPU table and local-GPU detection: CPU only, offline, no real CUDA needed."""

import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from hf_memfit.errors import MemFitError
from hf_memfit.hardware import GPUS, detect_local_gpu, find_gpu, gpu_memory_auto
from hf_memfit.units import GiB


@pytest.mark.parametrize("alias, name", [
    ("a100", "A100-80GB"), ("A100-80GB", "A100-80GB"), ("a100_80gb", "A100-80GB"),
    ("A100 40GB", "A100-40GB"), ("h100", "H100-80GB"), ("H100 PCIe", "H100-PCIe"),
    ("h200", "H200"), ("rtx3060", "RTX3060-12GB"), ("3060", "RTX3060-12GB"),
    ("4090", "RTX4090"), ("RTX 3090", "RTX3090"), ("t4", "T4"), ("v100", "V100-16GB"),
    ("v100-32gb", "V100-32GB"), ("A10G", "A10G"), ("l4", "L4"), ("L40S", "L40S"),
    ("a6000", "A6000"), ("rtx 6000 ada", "RTX6000-Ada"),
    # what torch.cuda.get_device_name() prints
    ("NVIDIA A100-SXM4-80GB", "A100-80GB"), ("NVIDIA A100-PCIE-40GB", "A100-40GB"),
    ("NVIDIA H100 80GB HBM3", "H100-80GB"), ("Tesla T4", "T4"), ("Tesla V100-SXM2-16GB", "V100-16GB"),
    ("NVIDIA GeForce RTX 3090", "RTX3090"), ("NVIDIA RTX A6000", "A6000"),
    ("NVIDIA RTX 6000 Ada Generation", "RTX6000-Ada"), ("nvidia_a100", "A100-80GB"),
])
def test_aliases_resolve(alias, name):
    assert find_gpu(alias).name == name


def test_every_row_finds_itself():
    for gpu in GPUS:
        assert find_gpu(gpu.name) is gpu
    assert len({gpu.name for gpu in GPUS}) == len(GPUS)


def test_unknown_gpu_error_is_one_line_listing_names():
    with pytest.raises(MemFitError) as err:
        find_gpu("B9000")
    message = str(err.value)
    assert "\n" not in message
    assert "`--gpu`" in message and "'B9000'" in message
    for gpu in GPUS:
        assert gpu.name in message


@pytest.mark.parametrize("gpu", GPUS, ids=lambda g: g.name)
def test_table_rows_are_sane(gpu):
    assert 10 * GiB < gpu.memory_bytes < 150 * GiB
    for value in (gpu.fp32_tflops, gpu.tf32_tflops, gpu.fp16_tflops,
                  gpu.hbm_bandwidth_bytes_per_s, gpu.pcie_bandwidth_bytes_per_s):
        assert value > 0
    assert gpu.nvlink_bandwidth_bytes_per_s >= 0
    assert gpu.fp32_tflops <= gpu.tf32_tflops < gpu.fp16_tflops
    ampere_plus = gpu.compute_capability >= (8, 0)
    assert gpu.supports_bf16 == ampere_plus
    assert gpu.supports_flash_attention == ampere_plus
    if not ampere_plus:  # no TF32 before Ampere: torch runs plain fp32
        assert gpu.tf32_tflops == gpu.fp32_tflops
    assert gpu.source


def test_usable_memory_is_below_the_marketing_size():
    # total_memory is what torch reports, a few percent under the nominal GB
    assert find_gpu("A100-80GB").memory_bytes < 80 * GiB
    assert find_gpu("T4").memory_bytes < 15 * GiB
    assert find_gpu("H200").memory_bytes < 141 * GiB  # "141GB" is 141 GiB less the driver's share


def test_matmul_tflops():
    assert find_gpu("h100").matmul_tflops("bf16") == find_gpu("h100").fp16_tflops
    assert find_gpu("t4").matmul_tflops("bfloat16") == 0.0
    assert find_gpu("t4").matmul_tflops("fp16") == 65.0
    with pytest.raises(MemFitError):
        find_gpu("t4").matmul_tflops("fp8")


def test_gpu_memory_auto_without_a_gpu():
    if detect_local_gpu() is not None:
        pytest.skip("a CUDA GPU is present")
    with pytest.raises(MemFitError, match="needs a CUDA GPU") as err:
        gpu_memory_auto()
    assert "--gpu-memory 24GiB" in str(err.value) and "\n" not in str(err.value)


def _fake_torch(name, total, free, cc, sms=108, threads=2048):
    props = SimpleNamespace(name=name, total_memory=total, major=cc[0], minor=cc[1], multi_processor_count=sms,
                            max_threads_per_multi_processor=threads)
    cuda = SimpleNamespace(is_available=lambda: True, get_device_properties=lambda i: props,
                           mem_get_info=lambda i=0: (free, total))
    return SimpleNamespace(cuda=cuda)


def test_detect_known_gpu_uses_the_driver_total(monkeypatch):
    monkeypatch.setitem(sys.modules, "torch", _fake_torch("NVIDIA A100-SXM4-80GB", 85_000_000_000,
                                                          84_000_000_000, (8, 0)))
    gpu, free = detect_local_gpu()
    assert gpu.name == "A100-80GB" and gpu.memory_bytes == 85_000_000_000
    assert gpu.fp16_tflops == 312.0 and free == 84_000_000_000
    assert gpu_memory_auto() == 84_000_000_000


def test_detect_unknown_gpu_builds_a_row(monkeypatch):
    monkeypatch.setitem(sys.modules, "torch", _fake_torch("NVIDIA B200", 190 * GiB, 180 * GiB, (10, 0), sms=148))
    gpu, free = detect_local_gpu()
    assert gpu.name == "NVIDIA B200" and gpu.compute_capability == (10, 0)
    assert gpu.supports_bf16 and gpu.memory_bytes == 190 * GiB and free == 180 * GiB
    # the SMs that size CUDA's reduction staging (estimator/reduction_staging.py) are the card's own
    assert (gpu.sm_count, gpu.max_threads_per_sm) == (148, 2048)


def test_every_table_gpu_has_the_sms_its_reduction_staging_needs():
    from hf_memfit.hardware import GPUS, MAX_THREADS_PER_SM

    for gpu in GPUS:
        assert gpu.sm_count > 0 and gpu.max_threads_per_sm == MAX_THREADS_PER_SM[gpu.compute_capability], gpu.name
    assert (find_gpu("h100").sm_count, find_gpu("t4").max_threads_per_sm) == (132, 1024)


def test_import_stays_torch_free():
    code = "import sys, hf_memfit.hardware, hf_memfit.estimator.cuda_overhead; print('torch' in sys.modules)"
    repo = Path(__file__).resolve().parents[1]
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=repo)
    assert out.stdout.strip() == "False"
