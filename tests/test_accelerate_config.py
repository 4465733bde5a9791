"""`hf-memfit plan --accelerate-config-out` writes a config for every layout, and accelerate itself reads each back."""

import json
import os

import pytest
import yaml

from hf_memfit.cli.main import main

# One plan per layout the planner picks; each case's budget is where that layout is the fastest that fits
# (the FSDP one is recipes/llama2_70b_qlora_2x24gb.py's plan).
_SHAPE = ["--seq-len", "512", "--global-batch-size", "8"]
LAYOUTS = {
    "NO": ["gpt2", "--gpu-memory", "12GiB", *_SHAPE],
    "MULTI_GPU": ["gpt2", "--gpu-memory", "12GiB", "--num-gpus", "2", "--num-nodes", "2", *_SHAPE],
    "DEEPSPEED": ["meta-llama/Llama-3.1-8B", "--gpu-memory", "40GiB", "--num-gpus", "4", *_SHAPE],
    "FSDP": ["meta-llama/Llama-2-70b-hf", "--gpu-memory", "24GiB", "--num-gpus", "2", "--load-in-4bit", "--lora-r", "8",
             "--lora-alpha", "16", "--cpu-memory", "128GiB", "--seq-len", "2048", "--global-batch-size", "4"],
}


def _plan(capsys, tmp_path, argv, *extra):
    code = main(["plan", *argv, "--json",
                 "--accelerate-config-out", str(tmp_path / "plan.yaml"), *extra])
    out, err = capsys.readouterr()
    assert code == 0, err
    return json.loads(out)["plan"], err


def _launch_args(path):
    """What `accelerate launch --config_file path train.py` makes of the file (its own parsing and defaults)."""
    from accelerate.commands.launch import _validate_launch_command, launch_command_parser

    args = launch_command_parser().parse_args(["--config_file", str(path), "train.py"])
    args, defaults, mp_from_config = _validate_launch_command(args)
    # what `launch_command` adds before `deepspeed_launcher` (accelerate 1.15 commands/launch.py): the YAML's
    # DeepSpeed keys, and mixed_precision when the YAML set it, which the plugin refuses beside a JSON file
    args.deepspeed_fields_from_accelerate_config = ",".join(
        list(defaults.deepspeed_config) + (["mixed_precision"] if mp_from_config else []))
    return args, defaults


@pytest.mark.parametrize("layout", LAYOUTS)
def test_every_layout_writes_a_config_accelerate_loads(layout, tmp_path, capsys, monkeypatch):
    from accelerate.commands.config.config_args import load_config_from_file

    plan, err = _plan(capsys, tmp_path, LAYOUTS[layout])
    settings = plan
    config = load_config_from_file(str(tmp_path / "plan.yaml"))
    assert config.distributed_type.value == layout
    world = settings["num_gpus"] * settings["num_nodes"]
    assert (config.num_processes, config.num_machines) == (world, settings["num_nodes"])
    args, _ = _launch_args(tmp_path / "plan.yaml")
    assert args.num_processes == world
    assert {"NO": not (args.multi_gpu or args.use_deepspeed or args.use_fsdp), "MULTI_GPU": args.multi_gpu,
            "DEEPSPEED": args.use_deepspeed, "FSDP": args.use_fsdp}[layout]
    precision = "bf16" if plan["bf16"] else "fp16" if plan["fp16"] else "no"
    if layout == "DEEPSPEED":
        # the precision lives in the JSON, which the YAML names; written beside it since no path was given
        ds_path = tmp_path / "plan.deepspeed.json"
        assert config.deepspeed_config["deepspeed_config_file"] == str(ds_path)
        assert str(ds_path) in err
        written = json.loads(ds_path.read_text())
        assert written == plan["deepspeed"]
        assert written["zero_optimization"]["stage"] == settings["zero_stage"]
        assert written["bf16"]["enabled"] == ("auto" if precision == "bf16" else False)
        assert config.deepspeed_config["zero3_init_flag"] is (settings["zero_stage"] == 3)
        _build_deepspeed_plugin(args, monkeypatch, settings["zero_stage"])
    else:
        assert args.mixed_precision == precision
        assert not (tmp_path / "plan.deepspeed.json").exists()


def _build_deepspeed_plugin(args, monkeypatch, stage):
    """The environment `accelerate launch` gives the training processes builds a DeepSpeed plugin from the JSON."""
    from accelerate.utils import DeepSpeedPlugin
    from accelerate.utils.launch import prepare_deepspeed_cmd_env

    _, env = prepare_deepspeed_cmd_env(args)
    for key in [k for k in os.environ if k.startswith("ACCELERATE_")]:
        monkeypatch.delenv(key)
    for key, value in env.items():
        if key.startswith("ACCELERATE_"):
            monkeypatch.setenv(key, value)
    # raises when the YAML sets what the JSON owns (mixed_precision, zero_stage, ...), as accelerate launch would
    plugin = DeepSpeedPlugin()
    assert plugin.zero_stage == stage
    assert plugin.deepspeed_config["train_micro_batch_size_per_gpu"] == "auto"  # filled by the Trainer


def test_deepspeed_json_goes_where_asked_and_the_yaml_names_it(tmp_path, capsys):
    ds_path = tmp_path / "configs" / "ds.json"
    plan, err = _plan(capsys, tmp_path, LAYOUTS["DEEPSPEED"], "--deepspeed-config-out", str(ds_path))
    written = yaml.safe_load((tmp_path / "plan.yaml").read_text())
    assert written["deepspeed_config"]["deepspeed_config_file"] == str(ds_path)
    assert "mixed_precision" not in written
    assert json.loads(ds_path.read_text()) == plan["deepspeed"]
    assert not (tmp_path / "plan.deepspeed.json").exists()


def test_multinode_deepspeed_uses_the_launcher_that_needs_no_hostfile(tmp_path):
    from accelerate.commands.config.config_args import ClusterConfig

    from hf_memfit.planner.accelerate import accelerate_config, write_accelerate_config
    from hf_memfit.settings import TrainSettings

    settings = TrainSettings(precision="bf16-mixed", num_gpus=8, num_nodes=2, zero_stage=3)
    path = write_accelerate_config(accelerate_config(settings, "ds.json"), tmp_path / "ds.yaml")
    loaded = ClusterConfig.from_yaml_file(str(path))
    assert loaded.num_processes == 16 and loaded.num_machines == 2
    assert loaded.deepspeed_config["deepspeed_multinode_launcher"] == "standard"


def test_zero_layout_without_a_json_path_is_refused():
    from hf_memfit.errors import MemFitError
    from hf_memfit.planner.accelerate import accelerate_config
    from hf_memfit.settings import TrainSettings

    with pytest.raises(MemFitError, match="--deepspeed-config-out"):
        accelerate_config(TrainSettings(precision="bf16-mixed", num_gpus=2, zero_stage=2))


def test_unwritable_accelerate_path_is_refused_before_planning(capsys):
    code = main(["plan", "gpt2", "--gpu-memory", "12GiB", "--seq-len", "128", "--global-batch-size", "8",
                 "--accelerate-config-out", "/proc/nonexistent/plan.yaml"])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and "--accelerate-config-out" in err
