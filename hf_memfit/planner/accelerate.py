"""Plan -> FSDP configs: accelerate's config file and the Trainer's `fsdp` / `fsdp_config` (pure dicts; no torch).

Two faces of the same layout, as users already write them:
- the YAML that `accelerate launch --config_file fsdp.yaml train.py` loads (the
  keys `accelerate config` writes: `distributed_type: FSDP` and an `fsdp_config`
  section of `fsdp_*` keys, accelerate 1.15 `commands/config/cluster.py`);
- `TrainingArguments(fsdp=True, fsdp_config={...})` (transformers 5.23: `version`,
  `reshard_after_forward`, `cpu_offload`, `auto_wrap_policy`).

Mixed precision is not in `fsdp_config`: accelerate derives FSDP's policy
(param_dtype = reduce_dtype = bf16/fp16) from `mixed_precision`, so the YAML sets
that and the Trainer takes it from `--bf16` / `--fp16`. Parameters are wrapped per
decoder layer (TRANSFORMER_BASED_WRAP reads the model's `_no_split_modules`),
which is the unit `sharding.wrap_units` models.

    python -m hf_memfit.planner.accelerate --fsdp full_shard --num-processes 2 --offload -o fsdp.yaml
"""

import argparse
import os
import sys
import tempfile
from pathlib import Path

from hf_memfit.errors import MemFitError
from hf_memfit.settings import FSDP_STRATEGIES, PRECISIONS, TrainSettings

AUTO_WRAP_POLICY = "TRANSFORMER_BASED_WRAP"


def _mixed_precision(precision: str) -> str:
    """accelerate's `mixed_precision` for a precision: its FSDP policy casts parameters to that dtype."""
    return "bf16" if precision.startswith("bf16") else "fp16" if precision.startswith("fp16") else "no"


def accelerate_fsdp_config(settings: TrainSettings) -> dict:
    """The accelerate config file (as a dict) that launches `settings`' FSDP layout on its GPUs and nodes."""
    if settings.fsdp is None:
        raise MemFitError("`--accelerate-config-out` writes an FSDP config, and this layout uses no FSDP")
    settings.replace(mode="fast").validate()
    fsdp = {
        "fsdp_version": settings.fsdp_version,
        "fsdp_auto_wrap_policy": AUTO_WRAP_POLICY,
        "fsdp_offload_params": settings.fsdp_offload,
        "fsdp_state_dict_type": "SHARDED_STATE_DICT",
        # Rank 0 loads the weights and broadcasts them; the others start on the meta device (host RAM).
        "fsdp_cpu_ram_efficient_loading": True,
        "fsdp_activation_checkpointing": False,  # the Trainer's --gradient_checkpointing does it
    }
    if settings.fsdp_version == 2:
        fsdp["fsdp_reshard_after_forward"] = settings.fsdp != "shard_grad_op"
    else:
        # FSDP1's plugin reads the strategy from fsdp_sharding_strategy (the launcher always passes one,
        # FULL_SHARD by default); `accelerate config` writes it as fsdp_reshard_after_forward too.
        fsdp["fsdp_sharding_strategy"] = settings.fsdp.upper()
        fsdp["fsdp_reshard_after_forward"] = settings.fsdp.upper()
        fsdp["fsdp_backward_prefetch"] = "BACKWARD_PRE"
        fsdp["fsdp_forward_prefetch"] = False
        fsdp["fsdp_use_orig_params"] = True  # required for LoRA's frozen/trainable mix in one unit
        fsdp["fsdp_sync_module_states"] = True  # cpu_ram_efficient_loading needs it with FSDP1
    return {
        "compute_environment": "LOCAL_MACHINE",
        "distributed_type": "FSDP",
        "debug": False,
        "downcast_bf16": "no",
        "enable_cpu_affinity": False,
        "fsdp_config": fsdp,
        "machine_rank": 0,
        "main_training_function": "main",
        "mixed_precision": _mixed_precision(settings.precision),
        "num_machines": settings.num_nodes,
        "num_processes": settings.world_size,
        "rdzv_backend": "static",
        "same_network": True,
        "tpu_env": [],
        "tpu_use_cluster": False,
        "tpu_use_sudo": False,
        "use_cpu": False,
    }


def trainer_fsdp_arguments(settings: TrainSettings) -> dict:
    """`TrainingArguments` fields for `settings`' FSDP layout: `fsdp=True` and its `fsdp_config`."""
    config: dict = {"version": settings.fsdp_version, "auto_wrap_policy": AUTO_WRAP_POLICY,
                    "cpu_offload": settings.fsdp_offload}
    if settings.fsdp_version == 2:
        config["reshard_after_forward"] = settings.fsdp != "shard_grad_op"
    else:
        config["reshard_after_forward"] = settings.fsdp
        config["backward_prefetch"] = "BACKWARD_PRE"
    return {"fsdp": True, "fsdp_config": config}


def write_accelerate_config(config: dict, path: str | os.PathLike) -> Path:
    """Write `config` as YAML to `path` (whole or not at all, like `deepspeed.write_deepspeed_config`)."""
    import yaml  # accelerate's own dependency, which reads the file back

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    text = yaml.safe_dump(config, sort_keys=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m hf_memfit.planner.accelerate",
        description="Write an accelerate FSDP config file (for `accelerate launch --config_file`).",
        epilog="examples:\n"
               "  python -m hf_memfit.planner.accelerate --fsdp full_shard --num-processes 2 --offload -o fsdp.yaml\n"
               "  python -m hf_memfit.planner.accelerate --fsdp hybrid_shard --fsdp-version 1 --num-processes 8 --num-machines 2",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--fsdp", choices=FSDP_STRATEGIES, default="full_shard")
    parser.add_argument("--fsdp-version", type=int, choices=(1, 2), default=2)
    parser.add_argument("--offload", action="store_true", help="CPU offload of parameters, gradients and the step")
    parser.add_argument("--num-processes", type=int, default=1, help="GPUs per node")
    parser.add_argument("--num-machines", type=int, default=1)
    parser.add_argument("--precision", default="bf16-mixed", choices=PRECISIONS)
    parser.add_argument("-o", "--output", help="the YAML file to write (default: print it)")
    args = parser.parse_args(argv)
    try:
        settings = TrainSettings(fsdp=args.fsdp, fsdp_version=args.fsdp_version, fsdp_offload=args.offload,
                                 num_gpus=args.num_processes, num_nodes=args.num_machines, precision=args.precision)
        config = accelerate_fsdp_config(settings)
    except MemFitError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.output:
        print(write_accelerate_config(config, args.output))
    else:
        import yaml

        print(yaml.safe_dump(config, sort_keys=True), end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
