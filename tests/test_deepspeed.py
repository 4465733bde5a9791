"""DeepSpeed configs: the shipped templates, DeepSpeed's own parser, invalid combinations, and real training.

The real-training tests run `tests/scripts/train_deepspeed.py` in a subprocess (DeepSpeed keeps
process-wide state) on the CPU, as a one-rank launch. On a fresh machine DeepSpeed first builds its
shm-comm and CPU-Adam C++ ops with ninja (about 1 and 2 minutes on 2 cores, cached in
~/.cache/torch_extensions); after that each run takes 10-20 s.
"""

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from hf_memfit.planner.deepspeed import TEMPLATES, deepspeed_config, main, write_deepspeed_config
from hf_memfit.errors import MemFitError

REPO = Path(__file__).resolve().parent.parent
DS_CONFIGS = REPO / "ds_configs"
TRAIN_SCRIPT = REPO / "tests" / "scripts" / "train_deepspeed.py"
HIDDEN = 64  # the fake model's hidden size for the "auto" bucket sizes

pytest.importorskip("deepspeed")


def _fill_auto(config: dict, tmp_path, **args) -> dict:
    """Replace "auto" exactly as the HF Trainer does, from real TrainingArguments."""
    from transformers import TrainingArguments
    from transformers.integrations.deepspeed import HfTrainerDeepSpeedConfig, unset_hf_deepspeed_config

    training_args = TrainingArguments(output_dir=str(tmp_path), per_device_train_batch_size=2,
                                      gradient_accumulation_steps=2, use_cpu=True, report_to=[], **args)
    model = type("Model", (), {"config": type("Config", (), {"hidden_size": HIDDEN})()})()
    hf_config = HfTrainerDeepSpeedConfig(json.loads(json.dumps(config)))
    try:
        hf_config.trainer_config_process(training_args)
        hf_config.trainer_config_finalize(training_args, model, num_training_steps=10)
        return hf_config.config
    finally:
        unset_hf_deepspeed_config()  # is_deepspeed_zero3_enabled() must not leak into other tests


def _has_auto(node) -> bool:
    if isinstance(node, dict):
        return any(_has_auto(v) for v in node.values())
    if isinstance(node, list):
        return any(_has_auto(v) for v in node)
    return node == "auto"


# -- templates -------------------------------------------------------------------------------

def test_shipped_templates_are_exactly_the_template_names():
    assert sorted(p.stem for p in DS_CONFIGS.glob("*.json")) == sorted(TEMPLATES)


@pytest.mark.parametrize("name", sorted(TEMPLATES))
def test_template_file_equals_writer(name):
    shipped = json.loads((DS_CONFIGS / f"{name}.json").read_text())
    assert shipped == deepspeed_config(**TEMPLATES[name]), (
        f"ds_configs/{name}.json is stale: run `python -m hf_memfit.planner.deepspeed --write-templates ds_configs`")


@pytest.mark.parametrize("name", sorted(TEMPLATES))
@pytest.mark.parametrize("bf16", [True, False])
def test_template_parses_with_deepspeed(name, bf16, tmp_path):
    from deepspeed.runtime.config import DeepSpeedConfig

    kwargs = TEMPLATES[name]
    filled = _fill_auto(json.loads((DS_CONFIGS / f"{name}.json").read_text()), tmp_path, bf16=bf16)
    assert not _has_auto(filled)
    ds = DeepSpeedConfig(filled)  # no distributed init: world size 1; runs DeepSpeed's batch and sanity checks
    assert ds.train_batch_size == 4 and ds.train_micro_batch_size_per_gpu == 2
    assert ds.gradient_accumulation_steps == 2
    assert ds.zero_optimization_stage == kwargs["zero_stage"]
    assert ds.bfloat16_config.enabled is bf16 and not ds.float16_config.enabled
    zero = ds.zero_config
    assert zero.reduce_bucket_size == HIDDEN**2
    assert zero.overlap_comm and zero.contiguous_gradients
    if kwargs["zero_stage"] == 3:
        assert zero.prefetch_bucket_size == int(0.9 * HIDDEN**2)
        assert zero.param_persistence_threshold == 10 * HIDDEN
        assert zero.gather_16bit_weights_on_model_save
    for what in ("offload_optimizer", "offload_param"):
        device = kwargs.get(what, "none")
        offload = getattr(zero, what)
        assert (offload.device if offload else "none") == device
        if device != "none":
            assert offload.pin_memory
        if device == "nvme":
            assert str(offload.nvme_path) == "/local_nvme"
    if "nvme" in kwargs.values():
        assert ds.aio_config["block_size"] == 1048576 and ds.aio_config["queue_depth"] == 32
    # DeepSpeed's own optimizer (CPU Adam) exactly when the optimizer is offloaded.
    assert (ds.optimizer_name == "adamw") == (kwargs.get("offload_optimizer", "none") != "none")


# -- precision -------------------------------------------------------------------------------

def test_precision_sections():
    bf16 = deepspeed_config(2, precision="bf16-mixed")
    assert bf16["bf16"] == {"enabled": "auto"} and bf16["fp16"] == {"enabled": False}
    fp16 = deepspeed_config(2, precision="fp16-mixed")
    assert fp16["fp16"]["enabled"] == "auto" and fp16["fp16"]["loss_scale"] == 0  # 0: dynamic
    assert fp16["bf16"] == {"enabled": False}
    fp32 = deepspeed_config(2, precision="fp32")
    assert fp32["bf16"] == {"enabled": False} and fp32["fp16"] == {"enabled": False}


def test_fp16_config_fills_from_args(tmp_path):
    filled = _fill_auto(deepspeed_config(3, precision="fp16-mixed"), tmp_path, fp16=False)
    assert filled["fp16"]["enabled"] is False  # "auto" follows --fp16


def test_disabled_precision_catches_mismatched_args(tmp_path):
    # An fp32 config with --bf16: the Trainer refuses instead of silently training in fp32.
    with pytest.raises(ValueError, match="bf16.enabled=False vs hf bf16"):
        _fill_auto(deepspeed_config(2, precision="fp32"), tmp_path, bf16=True)


# -- invalid combinations --------------------------------------------------------------------

@pytest.mark.parametrize("kwargs, flag", [
    ({"zero_stage": 2, "offload_param": "cpu"}, "`--offload-param` needs `--zero-stage 3`"),
    ({"zero_stage": 1, "offload_param": "nvme", "nvme_path": "/nvme"}, "`--offload-param` needs `--zero-stage 3`"),
    ({"zero_stage": 3, "offload_optimizer": "nvme"}, "`--nvme-path`"),
    ({"zero_stage": 3, "offload_param": "nvme"}, "`--nvme-path`"),
    ({"zero_stage": 2, "offload_optimizer": "nvme", "nvme_path": "/nvme"}, "`--offload-optimizer nvme` needs `--zero-stage 3`"),
    ({"zero_stage": 0}, "`--zero-stage`"),
    ({"zero_stage": 4}, "`--zero-stage`"),
    ({"zero_stage": 2, "offload_optimizer": "gpu"}, "`--offload-optimizer` must be one of"),
    ({"zero_stage": 2, "precision": "int8"}, "`--precision` must be one of"),
])
def test_invalid_combinations_raise(kwargs, flag):
    with pytest.raises(MemFitError) as info:
        deepspeed_config(**kwargs)
    message = str(info.value)
    assert flag in message and "\n" not in message


def test_unused_nvme_path_is_ignored():
    # The planner passes the user's --nvme-path whatever layout it picks.
    assert deepspeed_config(3, "cpu", nvme_path="/local_nvme") == deepspeed_config(3, "cpu")


def test_nvme_param_buffer_holds_the_largest_parameter():
    embedding = 128_256 * 4_096  # Llama-3 8B: more than DeepSpeed's default 1e8-element buffer
    config = deepspeed_config(**TEMPLATES["zero3_nvme"], largest_param_numel=embedding)
    assert config["zero_optimization"]["offload_param"]["buffer_size"] == embedding
    small = deepspeed_config(**TEMPLATES["zero3_nvme"], largest_param_numel=1000)
    assert small["zero_optimization"]["offload_param"]["buffer_size"] == 100_000_000


def test_settings_give_the_same_config():
    from hf_memfit.planner.deepspeed import deepspeed_config_for
    from hf_memfit.settings import TrainSettings

    settings = TrainSettings(zero_stage=3, offload_optimizer="cpu", offload_param="cpu", precision="bf16-mixed")
    assert deepspeed_config_for(settings) == deepspeed_config(**TEMPLATES["zero3_offload"])


def test_every_problem_reported_at_once():
    with pytest.raises(MemFitError) as info:
        deepspeed_config(2, offload_param="nvme", precision="int8")
    message = str(info.value)
    assert "`--offload-param`" in message and "`--nvme-path`" in message and "`--precision`" in message


def test_module_imports_no_torch():
    code = "import sys, hf_memfit.planner.deepspeed; sys.exit('torch' in sys.modules or 'deepspeed' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], cwd=REPO).returncode == 0


# -- writer and entry point ------------------------------------------------------------------

def test_writer_makes_dirs_overwrites_and_leaves_no_temp(tmp_path):
    path = tmp_path / "a" / "b" / "ds.json"
    assert write_deepspeed_config(deepspeed_config(2), path) == path
    write_deepspeed_config(deepspeed_config(3), path)
    assert json.loads(path.read_text()) == deepspeed_config(3)
    assert path.read_text().startswith('{\n  "bf16"')  # indent 2
    assert [p.name for p in path.parent.iterdir()] == ["ds.json"]


def test_writer_never_leaves_a_partial_file(tmp_path):
    path = tmp_path / "ds.json"
    write_deepspeed_config(deepspeed_config(2), path)
    with pytest.raises(TypeError):
        write_deepspeed_config({"zero_optimization": {"stage": object()}}, path)
    assert json.loads(path.read_text()) == deepspeed_config(2)
    assert [p.name for p in tmp_path.iterdir()] == ["ds.json"]


def test_cli_writes_templates_and_reports_errors(tmp_path, capsys):
    assert main(["--write-templates", str(tmp_path)]) == 0
    for name in TEMPLATES:
        assert (tmp_path / f"{name}.json").read_text() == (DS_CONFIGS / f"{name}.json").read_text()
    assert main(["--zero-stage", "2", "--offload-param", "cpu"]) == 2
    assert "`--offload-param` needs `--zero-stage 3`" in capsys.readouterr().err


# -- real training through the HF Trainer, on the CPU ----------------------------------------

def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _train(config_path: Path, tmp_path: Path, *extra: str, width: int = 64) -> dict:
    # A one-rank launch, as `deepspeed --num_gpus 1` would set it up.
    env = os.environ | {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1",
                        "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port()),
                        "PYTHONWARNINGS": "ignore", "TINY_WIDTH": str(width)}
    proc = subprocess.run(
        [sys.executable, str(TRAIN_SCRIPT), "--config", str(config_path), "--output-dir", str(tmp_path / "out"), *extra],
        env=env, cwd=REPO, capture_output=True, text=True, timeout=900,  # first run builds C++ ops
    )
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, f"training failed (rc={proc.returncode}):\n{(proc.stdout + proc.stderr)[-4000:]}"
    return json.loads(lines[-1].removeprefix("RESULT "))


@pytest.mark.slow
def test_trainer_zero2(tmp_path):
    path = write_deepspeed_config(deepspeed_config(**TEMPLATES["zero2"]), tmp_path / "zero2.json")
    result = _train(path, tmp_path)  # fp32: the template's bf16 "auto" follows --bf16 (off)
    assert result["zero_stage"] == 2 and result["bf16"] is False
    assert result["optimizer"] == "DeepSpeedZeroOptimizer"
    assert len(result["losses"]) == 3 and result["finite"]
    assert result["params_changed"] == result["params"] > 0


@pytest.mark.slow
def test_trainer_zero3_cpu_offload(tmp_path):
    path = write_deepspeed_config(deepspeed_config(**TEMPLATES["zero3_offload"]), tmp_path / "zero3_offload.json")
    result = _train(path, tmp_path, "--bf16", "--memfit", width=256)  # through MemFitTrainer
    assert result["zero_stage"] == 3 and result["bf16"] is True
    assert result["partitioned_at_init"]  # the model was built under zero.Init
    assert result["basic_optimizer"] == "DeepSpeedCPUAdam"
    assert result["offload_optimizer"] == "cpu" and result["offload_param"] == "cpu"
    assert len(result["losses"]) == 3 and result["finite"]
    assert result["params_changed"] == result["params"] > 0
    _check_memfit_plan(result, zero_stage=3, offload="cpu")


@pytest.mark.slow
def test_memfit_trainer_zero2_plans_for_the_users_config(tmp_path):
    path = write_deepspeed_config(deepspeed_config(**TEMPLATES["zero2"]), tmp_path / "zero2.json")
    result = _train(path, tmp_path, "--memfit", width=256)
    assert result["optimizer"] == "DeepSpeedZeroOptimizer" and len(result["losses"]) == 3 and result["finite"]
    _check_memfit_plan(result, zero_stage=2, offload="none")


def _check_memfit_plan(result: dict, zero_stage: int, offload: str) -> None:
    """MemFitTrainer planned around the user's DeepSpeed config, DeepSpeed ran the plan, and the memory agreed."""
    plan = result["plan"]
    assert plan["zero_stage"] == zero_stage and plan["offload_optimizer"] == offload
    assert (result["micro_batch"], result["accumulation"]) == (plan["micro_batch"], plan["accumulation"])
    # measured on the CPU, where DeepSpeed's device and host buffers share one memory
    assert abs(result["check"]["memfit/relative_error"]) < 0.10, result["check"]
