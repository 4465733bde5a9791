"""Ulysses sequence parallelism and context parallelism: the per-rank step, the planner, the configs, bad input."""

import json
import os

import pytest

from hf_memfit.cli.main import main
from hf_memfit.estimator.assemble import estimate
from hf_memfit.estimator.sequence import ring_terms, ulysses_terms
from hf_memfit.models.spec import ModelSpec

LLAMA = dict(model_type="llama", num_hidden_layers=4, hidden_size=256, intermediate_size=688, num_attention_heads=8,
             num_key_value_heads=2, vocab_size=8192, max_position_embeddings=512, tie_word_embeddings=False)
GPU = dict(device="cuda", gpu="h100", precision="bf16-mixed", task="causal-lm", attn_implementation="sdpa")


def _spec(**changes):
    return ModelSpec.from_config("llama-small", {**LLAMA, **changes})


def test_a_ulysses_rank_runs_the_local_step_plus_the_exchange():
    """Activations at seq 2S over sp=2 are those of seq S whole; the exchange adds temporaries at layer regions only."""
    spec = _spec()
    split = estimate(spec, batch_size=1, seq_len=4096, num_gpus=2, zero_stage=3, sp_size=2, **GPU)
    local = estimate(spec, batch_size=1, seq_len=2048, num_gpus=2, zero_stage=3, **GPU)
    assert split.breakdown["weights"] == local.breakdown["weights"]  # ZeRO over the whole world either way
    assert split.breakdown["optimizer"] == local.breakdown["optimizer"]
    terms = ulysses_terms(spec, split.settings.replace(precision="bf16"))
    assert terms["saved_per_layer"] == 0  # 2 KV heads split over sp=2: nothing repeated
    reduce_fp32 = 2 * 4 * 256 * 256  # DeepSpeed reduces SP gradients in fp32 (seq_parallel_communication_data_type)
    assert 0 <= split.peak_allocated_bytes - local.peak_allocated_bytes <= terms["forward"] + reduce_fp32
    assert any("Ulysses SP over 2 ranks" in note for note in split.notes)


def test_sp_above_the_kv_heads_keeps_repeated_kv_for_backward():
    spec = _spec()
    settings = estimate(spec, batch_size=1, seq_len=4096, num_gpus=4, zero_stage=1, sp_size=4, **GPU).settings
    assert ulysses_terms(spec, settings)["saved_per_layer"] > 0  # 2 KV heads repeated to one per rank


def test_ring_attention_gathers_the_whole_sequence_of_kv():
    spec = _spec()
    two = estimate(spec, batch_size=1, seq_len=4096, num_gpus=2, fsdp="full_shard", cp_size=2, **GPU).settings
    four = two.replace(num_gpus=4, cp_size=4)
    # four ranks hold half the local tokens each, but gather all of K and V: the gathered part stays the same
    assert ring_terms(spec, four)["forward"] < ring_terms(spec, two)["forward"]
    assert ring_terms(spec, four)["backward"] > 0


def test_fast_and_exact_agree_under_sequence_parallelism():
    spec = _spec()
    kwargs = dict(batch_size=1, seq_len=2048, num_gpus=2, zero_stage=1, sp_size=2, device="cpu", precision="fp32",
                  optim="adamw_torch", task="causal-lm", attn_implementation="sdpa")
    fast, exact = estimate(spec, **kwargs), estimate(spec, mode="exact", **kwargs)
    assert abs(fast.device_total_bytes / exact.device_total_bytes - 1) < 0.05


def test_the_planner_splits_a_sequence_that_does_not_fit_whole():
    from hf_memfit.planner.search import plan

    result = plan("meta-llama/Llama-3.1-8B", seq_len=131072, global_batch_size=8, num_gpus=8, gpu="h100")
    s = result.plan.settings
    assert s.sp_size > 1 and s.zero_stage and s.dp_size * s.sp_size == 8
    assert s.batch_size * s.gradient_accumulation_steps * s.dp_size == 8  # the global batch is kept
    assert result.plan.deepspeed["sequence_parallel_size"] == s.sp_size
    assert result.plan.parallelism_config["sp_size"] == s.sp_size
    assert any("Ulysses sequence parallelism" in r and "nothing fits with whole sequences" in r
               for r in result.plan.reasons)


def test_the_planner_keeps_whole_sequences_for_a_short_run():
    from hf_memfit.planner.search import plan

    result = plan("meta-llama/Llama-3.1-8B", seq_len=2048, global_batch_size=8, num_gpus=8, gpu="h100")
    assert result.plan.settings.sp_size == 1


def test_a_refusal_names_sequence_parallelism(capsys):
    code = main(["plan", "meta-llama/Llama-3.1-8B", "--seq-len", "131072", "--global-batch-size", "8",
                 "--num-gpus", "8", "--gpu", "h100", "--sp-size", "1"])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and "`--sp-size 8`" in err


@pytest.mark.parametrize("argv, message", [
    (["meta-llama/Llama-3.1-8B", "--sp-size", "3", "--num-gpus", "8", "--zero-stage", "3"], "must divide the 8 GPU"),
    (["Qwen/Qwen2.5-7B", "--sp-size", "8", "--num-gpus", "8", "--zero-stage", "3"], "28 attention heads"),
    (["meta-llama/Llama-3.1-8B", "--sp-size", "2", "--num-gpus", "2", "--zero-stage", "3",
      "--attn-implementation", "eager"], "not eager"),
    (["gpt2", "--sp-size", "2", "--num-gpus", "2", "--zero-stage", "3"], "cannot shard"),
    (["meta-llama/Llama-3.1-8B", "--sp-size", "2", "--num-gpus", "2"], "add `--zero-stage 1`"),
    (["meta-llama/Llama-3.1-8B", "--cp-size", "2", "--num-gpus", "2", "--zero-stage", "3"], "--fsdp full_shard"),
    (["meta-llama/Llama-3.1-8B", "--sp-size", "2", "--cp-size", "2", "--num-gpus", "4", "--zero-stage", "3"],
     "pick one"),
])
def test_bad_sequence_parallel_input_is_one_line(argv, message, capsys):
    code = main(["estimate", *argv, "--seq-len", "8192", "--batch-size", "1"])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and message in err, err


def _launch(path, monkeypatch, prepare):
    """What `accelerate launch --config_file path` exports to the training processes, set in this process."""
    from accelerate.commands.launch import _validate_launch_command, launch_command_parser

    args = launch_command_parser().parse_args(["--config_file", str(path), "train.py"])
    args, defaults, _ = _validate_launch_command(args)
    args.deepspeed_fields_from_accelerate_config = ",".join(defaults.deepspeed_config)
    env = prepare(args)
    env = env[1] if isinstance(env, tuple) else env
    for key in [k for k in os.environ if k.startswith(("ACCELERATE_", "PARALLELISM_CONFIG_"))]:
        monkeypatch.delenv(key)
    for key, value in env.items():
        if key.startswith(("ACCELERATE_", "PARALLELISM_CONFIG_")):
            monkeypatch.setenv(key, value)
    return args


def test_an_sp_plan_writes_configs_accelerate_launches(tmp_path, capsys, monkeypatch):
    from accelerate.commands.config.config_args import load_config_from_file
    from accelerate.parallelism_config import ParallelismConfig
    from accelerate.utils import DeepSpeedPlugin
    from accelerate.utils.launch import prepare_deepspeed_cmd_env

    code = main(["plan", "meta-llama/Llama-3.1-8B", "--seq-len", "131072", "--global-batch-size", "8",
                 "--num-gpus", "8", "--gpu", "h100", "--json", "--accelerate-config-out", str(tmp_path / "sp.yaml")])
    out, err = capsys.readouterr()
    assert code == 0, err
    plan = json.loads(out)["plan"]
    config = load_config_from_file(str(tmp_path / "sp.yaml"))
    assert config.distributed_type.value == "DEEPSPEED"
    assert config.parallelism_config["parallelism_config_sp_size"] == plan["sp_size"]
    written = json.loads((tmp_path / "sp.deepspeed.json").read_text())
    assert written["sequence_parallel_size"] == plan["sp_size"]
    args = _launch(tmp_path / "sp.yaml", monkeypatch, prepare_deepspeed_cmd_env)
    assert args.use_parallelism_config and args.use_deepspeed
    built = ParallelismConfig()  # what the Trainer's accelerator builds from ACCELERATE_USE_PARALLELISM_CONFIG
    assert (built.sp_size, built.sp_backend) == (plan["sp_size"], "deepspeed")
    assert built.sp_handler.sp_attn_implementation == plan["attn_implementation"]
    assert DeepSpeedPlugin().zero_stage == plan["zero_stage"]


def test_a_cp_plan_writes_an_fsdp2_config_with_its_mesh(tmp_path, capsys, monkeypatch):
    from accelerate.commands.config.config_args import load_config_from_file
    from accelerate.parallelism_config import ParallelismConfig
    from accelerate.utils.launch import prepare_multi_gpu_env

    code = main(["plan", "meta-llama/Llama-3.1-8B", "--seq-len", "131072", "--global-batch-size", "8",
                 "--num-gpus", "8", "--gpu", "h100", "--sp-size", "1", "--cp-size", "auto", "--json",
                 "--accelerate-config-out", str(tmp_path / "cp.yaml")])
    out, err = capsys.readouterr()
    assert code == 0, err
    plan = json.loads(out)["plan"]
    assert plan["cp_size"] > 1 and plan["fsdp_strategy"] == "full_shard" and plan["attn_implementation"] == "sdpa"
    config = load_config_from_file(str(tmp_path / "cp.yaml"))
    assert config.distributed_type.value == "FSDP"
    _launch(tmp_path / "cp.yaml", monkeypatch, prepare_multi_gpu_env)
    built = ParallelismConfig()
    assert built.cp_size == plan["cp_size"] and built.total_size == 8  # accelerate checks it against the processes


@pytest.mark.slow
def test_memfit_trainer_plans_and_checks_a_two_rank_ulysses_run(tmp_path):
    """2 processes over gloo on the CPU (about 40 s on 2 cores): the SP ranks are not counted as data parallel."""
    import socket
    import subprocess
    import sys
    from pathlib import Path

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    script = Path(__file__).resolve().parent / "scripts" / "train_sequence_parallel.py"
    env = os.environ | {"DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
                           "--master_port", str(port), str(script), str(tmp_path)],
                          capture_output=True, text=True, timeout=600, env=env)
    files = sorted(tmp_path.glob("rank*.json"))
    assert proc.returncode == 0 and len(files) == 2, (proc.stdout + proc.stderr)[-4000:]
    for result in (json.loads(path.read_text()) for path in files):
        # per-device batch 2 x 1 data-parallel replica is the global batch the run asked for; on the CPU the plan
        # runs it as micro-batches of 1 (2+ rows fail in the CPU launch of DeepSpeed's SP data loader)
        assert (result["sp_size"], result["dp_size"], result["zero_stage"]) == (2, 1, 1)
        assert (result["batch_size"], result["accumulation"], result["seq_len"]) == (1, 2, 512)
        assert result["memfit/predicted_peak_bytes"] > 0 and result["loss"] is not None
        # the trainer's own CPU measurement of the steady step, beside the plan's prediction
        assert abs(result["memfit/relative_error"]) < 0.10, result


def test_the_speed_model_pays_for_the_exchange_over_the_slowest_link():
    from hf_memfit.hardware import find_gpu
    from hf_memfit.planner.speed import sequence_exchange_bytes, step_seconds

    spec = ModelSpec.from_config("meta-llama/Llama-3.1-8B", _llama8b_config())
    kwargs = dict(batch_size=1, seq_len=131072, gradient_checkpointing=True, zero_stage=3, **GPU)
    one_node = estimate(spec, num_gpus=8, sp_size=8, **kwargs)
    two_nodes = estimate(spec, num_gpus=4, num_nodes=2, sp_size=8, **kwargs)  # the group spans InfiniBand
    assert sequence_exchange_bytes(spec, one_node.settings) == sequence_exchange_bytes(spec, two_nodes.settings) > 0
    gpu = find_gpu("h100")
    assert step_seconds(spec, two_nodes.settings, two_nodes, gpu) > step_seconds(spec, one_node.settings, one_node, gpu)
    assert sequence_exchange_bytes(spec, one_node.settings.replace(sp_size=1, zero_stage=3)) == 0


def _llama8b_config():
    from hf_memfit.models.spec import load_model_config

    return load_model_config("meta-llama/Llama-3.1-8B")[1]
