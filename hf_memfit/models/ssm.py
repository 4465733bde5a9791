"""State-space mixers (Mamba, Mamba-2 and the hybrids that use them): what a model's mixers are, and which
layouts the CUDA kernels of `mamba-ssm` / `causal-conv1d` refuse.

transformers (5.x) trains a state-space mixer on one of two paths (`modeling_mamba.py` and its copies):
- the **kernel path**: with `mamba-ssm` and `causal-conv1d` installed (CUDA builds), the mixer's module-level
  `mamba_inner_fn` (Mamba, FalconMamba), `mamba2_split_conv1d_scan_combined` (Mamba-2, Falcon-H1, Zamba2,
  Bamba, NemotronH) or `causal_conv1d_fn` + `mamba_selective_scan` (Jamba) resolve to the packages' autograd
  Functions (`use_kernel_func_from_hub_with_fallback`); the fused calls run when `self.training and cache is
  None`, which is the Trainer's step;
- the **torch fallback** (no package, or a CPU): `slow_forward`-style code that materialises the
  discretised state [b, d_inner, s, d_state] (Mamba) or the chunked SSD tensors (Mamba-2).

`mixers(model)` reads the layouts from a built (meta) model, with no per-family code: a mixer is a module with
an `A_log` parameter and a `conv1d`; a 2-D `A_log` [d_inner, d_state] is Mamba-1's selective scan, a 1-D one
[heads] is Mamba-2's chunked scan (SSD). `kernel_problems` lists what the kernels refuse, from their source.
"""

from __future__ import annotations

import math

SSM_KERNELS = ("cuda", "torch")


def mixers(model) -> list[dict]:
    """The distinct state-space mixer layouts of a built model (meta device is enough), with their counts."""
    found: dict[tuple, dict] = {}
    for module in model.modules():
        a_log = getattr(module, "A_log", None)
        conv = getattr(module, "conv1d", None)
        if a_log is None or conv is None or not hasattr(conv, "weight"):
            continue
        scan = "selective_scan" if a_log.dim() == 2 else "ssd"
        layout = {
            "scan": scan,
            "d_state": int(a_log.shape[1]) if scan == "selective_scan" else int(getattr(module, "ssm_state_size", 0)),
            "conv_kernel": int(conv.weight.shape[-1]),
            "conv_dim": int(conv.weight.shape[0]),
            "heads": int(a_log.shape[0]) if scan == "ssd" else 0,
            "head_dim": int(getattr(module, "head_dim", 0) or 0) if scan == "ssd" else 0,
            "n_groups": int(getattr(module, "n_groups", 1) or 1) if scan == "ssd" else 1,
            "chunk_size": int(getattr(module, "chunk_size", 0) or 0) if scan == "ssd" else 0,
            "in_proj": int(module.in_proj.weight.shape[0]) if hasattr(getattr(module, "in_proj", None), "weight") else 0,
        }
        key = tuple(sorted(layout.items()))
        found.setdefault(key, dict(layout, count=0))["count"] += 1
    return list(found.values())


def _peft_refusal(model_type: str, targets: list[str]) -> str | None:
    """peft's own check (tuners_utils._check_lora_target_modules_mamba): LoRA on a mixer's `out_proj` or
    `conv1d` is refused for the model types whose fused kernel reads those weights directly."""
    from types import SimpleNamespace

    from peft import LoraConfig
    from peft.tuners.tuners_utils import _check_lora_target_modules_mamba

    config = LoraConfig(target_modules=targets)
    model = SimpleNamespace(config=SimpleNamespace(model_type=model_type))
    for target in targets:
        try:
            _check_lora_target_modules_mamba(config, model, target)
        except ValueError as error:
            return str(error).split(". Please")[0]
    return None


def kernel_problems(layouts: list[dict], settings, spec) -> list[str]:
    """What the CUDA kernels (or the libraries around them) refuse for these mixers under `settings`."""
    if not layouts:
        return []
    name = spec.name
    problems = []
    if settings.uses_lora and settings.lora_target_modules:
        targets = list(settings.lora_target_modules)
        if "all-linear" in targets:  # peft expands it to every linear but the output head
            targets = sorted({m.name for m in spec.linear_modules()} | set(targets) - {"all-linear"})
        refusal = _peft_refusal(spec.model_type, targets)
        if refusal:
            kept = [t for t in targets if t not in ("out_proj", "conv1d")]
            problems.append(f"`--lora-target-modules`: peft refuses it ({refusal}): use "
                            f"`--lora-target-modules {','.join(kept) or 'in_proj'}`")
    path = settings.ssm_path
    if settings.sp_size > 1 or settings.cp_size > 1:
        flag = f"--sp-size {settings.sp_size}" if settings.sp_size > 1 else f"--cp-size {settings.cp_size}"
        # A mixer's scan carries its state along the whole sequence: Ulysses' all-to-all wraps attention
        # only (DeepSpeed UlyssesSPAttentionHF), and ring attention patches SDPA only; neither splits a scan.
        problems.append(f"`{flag}`: {name}'s state-space mixers scan the whole sequence on one rank; sequence "
                        f"parallelism splits attention only: drop `{flag.split()[0]}`")
    if path != "cuda":
        return problems
    if settings.device != "cuda":
        problems.append("`--ssm-kernels cuda`: mamba-ssm / causal-conv1d are CUDA kernels: use `--device cuda`, "
                        "or `--ssm-kernels torch`")
    for layout in layouts:
        width = layout["conv_kernel"]
        if not 2 <= width <= 4:  # causal-conv1d csrc/causal_conv1d.cpp: TORCH_CHECK(width >= 2 && width <= 4)
            problems.append(f"`--ssm-kernels cuda`: causal-conv1d supports a conv width of 2 to 4, and {name}'s "
                            f"is {width}: use `--ssm-kernels torch` (transformers' fallback)")
        if layout["scan"] == "selective_scan" and layout["d_state"] > 256:
            # mamba-ssm csrc/selective_scan/selective_scan.cpp: "selective_scan only supports state dimension <= 256"
            problems.append(f"`--ssm-kernels cuda`: mamba-ssm's selective scan supports d_state <= 256, and "
                            f"{name}'s is {layout['d_state']}: use `--ssm-kernels torch`")
        if layout["scan"] == "ssd":
            if layout["in_proj"] % 8:
                # causal-conv1d, channel-last input (Mamba-2 passes a slice of in_proj's output): "causal_conv1d
                # with channel last layout requires strides (x.stride(0) and x.stride(2)) to be multiples of 8"
                problems.append(f"`--ssm-kernels cuda`: causal-conv1d reads Mamba-2's conv input from in_proj's "
                                f"output, whose width {layout['in_proj']} must be a multiple of 8: use "
                                "`--ssm-kernels torch`")
            group = layout["heads"] * layout["head_dim"] // max(layout["n_groups"], 1)
            itemsize = 4 if settings.compute_dtype == "float32" else 2
            if group * itemsize > 65536:
                # mamba-ssm ops/triton/layernorm_gated.py: "This layer norm doesn't support feature dim >= 64KB."
                problems.append(f"`--ssm-kernels cuda`: mamba-ssm's gated RMSNorm takes groups of up to 64 KiB, "
                                f"and {name}'s is {group} x {itemsize} B: use `--ssm-kernels torch`")
    return list(dict.fromkeys(problems))


# mamba-ssm csrc/selective_scan/selective_scan.cpp: the forward keeps x = zeros({batch, dim, n_chunks, dstate * 2})
# with n_chunks = ceil(seqlen / 2048) (`estimator/ssm_kernels.py` allocates it).
SELECTIVE_SCAN_CHUNK = 2048


def sequence_chunk(layouts: list[dict], settings) -> int:
    """The length a step's state-space working set comes in whole chunks of (ceil(s / chunk) of them; 1: none).

    Mamba-2's chunked scan (SSD) tiles the sequence by the mixer's `chunk_size` on both paths (the kernels'
    nchunks = ceil(s / chunk); transformers' torch fallback pads the sequence to a multiple of it); Mamba-1's
    selective scan keeps its chunk states on the kernel path only (the torch fallback steps token by token).
    A step is a polynomial in the length only at multiples of the chunk: fits are traced there (`parametric`).
    """
    chunk = 1
    for layout in layouts:
        if layout["scan"] == "ssd" and layout["chunk_size"]:
            size = layout["chunk_size"]
        elif layout["scan"] == "selective_scan" and settings.ssm_path == "cuda":
            size = SELECTIVE_SCAN_CHUNK
        else:
            continue
        chunk = math.lcm(chunk, size)
    return chunk


def path_note(layouts: list[dict], settings) -> str | None:
    """Which kernel path an estimate of a state-space model is for (None for other models)."""
    if not layouts:
        return None
    scans = sorted({layout["scan"] for layout in layouts})
    if settings.ssm_path == "cuda":
        fused = " + ".join({"selective_scan": "selective_scan / mamba_inner_fn", "ssd":
                            "mamba_split_conv1d_scan_combined"}[s] for s in scans)
        return (f"state-space mixers: the CUDA kernel path (mamba-ssm {fused}, causal-conv1d), which saves the "
                "inputs and recomputes in backward; `--ssm-kernels torch` estimates transformers' torch fallback")
    return ("state-space mixers: transformers' torch fallback (no mamba-ssm / causal-conv1d, or a CPU), which "
            "materialises the discretised state per token; `--ssm-kernels cuda` estimates the CUDA kernels")
