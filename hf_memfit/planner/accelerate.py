"""Plan -> accelerate config file for every layout, and the Trainer's `fsdp` / `fsdp_config` (pure dicts; no torch).

`accelerate_config(settings)` is the YAML that `accelerate launch --config_file
plan.yaml train.py` loads, with the keys `accelerate config` writes (accelerate 1.15
`commands/config/cluster.py`), for each layout the planner picks:
- one GPU: `distributed_type: "NO"`, one process;
- DDP on several GPUs or nodes: `distributed_type: MULTI_GPU`;
- DeepSpeed ZeRO: `distributed_type: DEEPSPEED` with `deepspeed_config.deepspeed_config_file`
  naming the plan's DeepSpeed JSON (`deepspeed.py`, "auto" wherever the Trainer fills
  the value). No `mixed_precision` key then: with a config file accelerate takes the
  precision from the JSON's `bf16` / `fp16` sections and stops with "the following
  accelerate config variables will be ignored" when the YAML also sets it
  (`DeepSpeedPlugin._deepspeed_config_checks`, accelerate 1.15);
- FSDP: `distributed_type: FSDP` and an `fsdp_config` section of `fsdp_*` keys.

FSDP also has a second face, `TrainingArguments(fsdp=True, fsdp_config={...})`
(transformers 5.23: `version`, `reshard_after_forward`, `cpu_offload`, `auto_wrap_policy`).

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


def _launch_fields(settings: TrainSettings) -> dict:
    """The keys every layout's file has: where it runs, how many processes, the precision, the defaults."""
    return {
        "compute_environment": "LOCAL_MACHINE",
        "debug": False,
        "downcast_bf16": "no",
        "enable_cpu_affinity": False,
        "machine_rank": 0,  # each node passes its own `--machine_rank` to `accelerate launch`
        "main_training_function": "main",
        "mixed_precision": _mixed_precision(settings.precision),
        "num_machines": settings.num_nodes,
        "num_processes": settings.world_size,  # accelerate's count is over all machines
        "rdzv_backend": "static",
        "same_network": True,
        "tpu_env": [],
        "tpu_use_cluster": False,
        "tpu_use_sudo": False,
        "use_cpu": settings.device == "cpu",
    }


def accelerate_config(settings: TrainSettings, deepspeed_config_file: str | os.PathLike | None = None) -> dict:
    """The accelerate config file (as a dict) that launches `settings`' layout: one GPU, DDP, DeepSpeed or FSDP.

    A ZeRO layout needs `deepspeed_config_file`, the path of the plan's DeepSpeed JSON as
    the launching process will open it (relative paths resolve from where `accelerate
    launch` runs).
    """
    if settings.fsdp is not None:
        return accelerate_fsdp_config(settings)
    settings.replace(mode="fast").validate()
    config = _launch_fields(settings)
    if settings.zero_stage:
        if not deepspeed_config_file:
            raise MemFitError("this plan uses DeepSpeed ZeRO: its accelerate config names the DeepSpeed JSON; "
                              "give `--deepspeed-config-out FILE` (or let `--accelerate-config-out` write it beside)")
        del config["mixed_precision"]  # the JSON's bf16 / fp16 sections own it (see the module docstring)
        ds = {"deepspeed_config_file": str(deepspeed_config_file),
              # ZeRO-3 builds the model already partitioned (deepspeed.zero.Init), as the plan's peak assumes
              "zero3_init_flag": settings.zero_stage == 3}
        if settings.num_nodes > 1:
            # "standard": each node runs `accelerate launch --machine_rank R`, no pdsh hostfile needed
            # (accelerate's DEEPSPEED_MULTINODE_LAUNCHERS; its default pdsh needs passwordless ssh)
            ds["deepspeed_multinode_launcher"] = "standard"
        config = {**config, "distributed_type": "DEEPSPEED", "deepspeed_config": ds}
        if settings.sp_size > 1:
            config["parallelism_config"] = launch_parallelism_config(settings)
        return config
    if settings.world_size > 1:
        return {**config, "distributed_type": "MULTI_CPU" if settings.device == "cpu" else "MULTI_GPU"}
    return {**config, "distributed_type": "NO"}


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
    config = {**_launch_fields(settings), "distributed_type": "FSDP", "fsdp_config": fsdp}
    if settings.cp_size > 1:
        config["parallelism_config"] = launch_parallelism_config(settings)
    return config


def parallelism_config_kwargs(settings: TrainSettings) -> dict:
    """`accelerate.ParallelismConfig` keyword arguments for the plan's sequence split ({} without one).

    Ulysses: sp_size with the DeepSpeed backend and `DeepSpeedSequenceParallelConfig(sp_attn_implementation=...)`
    under "sp_handler" (variable sequence lengths, accelerate's default); context parallelism: cp_size over
    FSDP2's dp_shard dimension (the rest of the world), ring attention all-gathering K/V ("allgather",
    accelerate's default `cp_comm_strategy`).
    """
    if settings.sp_size > 1:
        return {"sp_size": settings.sp_size, "sp_backend": "deepspeed",
                "sp_handler": {"sp_attn_implementation": settings.attn_implementation or "sdpa",
                               "sp_seq_length_is_variable": True}}
    if settings.cp_size > 1:
        return {"cp_size": settings.cp_size, "cp_backend": "torch", "dp_shard_size": settings.dp_size,
                "cp_handler": {"cp_comm_strategy": "allgather"}}
    return {}


def launch_parallelism_config(settings: TrainSettings) -> dict:
    """The accelerate config file's `parallelism_config` section: `accelerate launch`'s `--parallelism_config_*` keys.

    `accelerate launch` copies each key onto its own argument and exports PARALLELISM_CONFIG_* to the script,
    from which `ParallelismConfig()` (which the Trainer builds when ACCELERATE_USE_PARALLELISM_CONFIG is set)
    reads its sizes (accelerate 1.15 `commands/launch.py`, `utils/launch.py` prepare_extend_env_parallelism_config).
    """
    kwargs = parallelism_config_kwargs(settings)
    section = {f"parallelism_config_{k}": v for k, v in kwargs.items() if not k.endswith("_handler")}
    for handler in ("sp_handler", "cp_handler"):
        section |= {f"parallelism_config_{k}": v for k, v in kwargs.get(handler, {}).items()}
    return section


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


def write_plan_configs(settings: TrainSettings, deepspeed: dict | None, accelerate_out: str | None,
                       deepspeed_out: str | None) -> tuple[list[str], str | None]:
    """Write a plan's accelerate YAML and DeepSpeed JSON where asked.

    Returns one note per thing to tell the user, and where the DeepSpeed JSON went (or None).

    A ZeRO plan's YAML must name a DeepSpeed JSON; without `--deepspeed-config-out` the
    JSON goes beside the YAML (`plan.yaml` -> `plan.deepspeed.json`), under the same
    folder as given, so the pair stays together and the YAML's relative path still
    resolves from where both were written.
    """
    notes = []
    if deepspeed is not None and accelerate_out and not deepspeed_out:
        stem = os.path.splitext(os.path.basename(accelerate_out))[0]
        deepspeed_out = os.path.join(os.path.dirname(accelerate_out), f"{stem}.deepspeed.json")
        notes.append(f"the plan uses DeepSpeed ZeRO-{settings.zero_stage}: wrote its DeepSpeed config to "
                     f"{deepspeed_out}, which {accelerate_out} names (`--deepspeed-config-out FILE` puts it elsewhere)")
    if deepspeed_out:
        if deepspeed is None:
            notes.append("the plan needs no DeepSpeed; no DeepSpeed config written")
            deepspeed_out = None
        else:
            from hf_memfit.planner.deepspeed import write_deepspeed_config

            write_deepspeed_config(deepspeed, deepspeed_out)
    if accelerate_out:
        config = accelerate_config(settings, deepspeed_out if deepspeed is not None else None)
        write_accelerate_config(config, accelerate_out)
        notes.append(f"wrote {accelerate_out} ({_describe(config)}): `accelerate launch --config_file "
                     f"{accelerate_out} train.py`" + (
                         "; on every node add --machine_rank R --main_process_ip HOST"
                         if settings.num_nodes > 1 else ""))
    return notes, deepspeed_out


def _describe(config: dict) -> str:
    kind = {"NO": "one process", "MULTI_GPU": "DDP", "MULTI_CPU": "DDP on the CPU", "DEEPSPEED": "DeepSpeed",
            "FSDP": f"FSDP{config.get('fsdp_config', {}).get('fsdp_version', '')}"}[config["distributed_type"]]
    return f"{kind}, {config['num_processes']} process(es) on {config['num_machines']} machine(s)"


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
