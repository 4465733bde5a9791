"""The recipes: every `--dry-run` and `--smoke`, the script entry point, user errors, the README table,
the accelerate configs and the Dockerfile. Offline, CPU only.

The smokes run in-process (one import of torch and transformers for all of
them); `test_script_runs_as_a_subprocess` runs one as the real script.
"""

import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from hf_memfit.errors import MemFitError
from hf_memfit.integrations.recipe import execute, load_recipe_module, readme_table, readme_with_table, run
from hf_memfit.models.spec import resolve_model
from hf_memfit.units import GiB, parse_bytes

REPO = Path(__file__).resolve().parents[1]
RECIPES = sorted(path.stem for path in (REPO / "recipes").glob("*.py"))


def recipe(name: str):
    return load_recipe_module(REPO / "recipes" / f"{name}.py").RECIPE


def test_the_issue_recipes_exist():
    assert {"gpt2xl_12gb", "llama31_8b_qlora_24gb", "mistral7b_lora_16gb", "t5_3b_24gb", "bert_large_cls_8gb",
            "llama2_70b_8x80gb", "long_context_sft"} <= set(RECIPES)


# --- --dry-run -----------------------------------------------------------------------------

@pytest.mark.parametrize("name", RECIPES)
def test_dry_run_plans_the_real_model_within_its_budget(name, capsys):
    rec = recipe(name)
    result = execute(rec, ["--dry-run"])
    p, s = result.plan, result.plan.settings
    assert capsys.readouterr().out.startswith(f"Plan for {resolve_model(rec.model).name}: {rec.seq_len} tokens")
    assert p.budget_bytes == parse_bytes(rec.memory_budget)
    assert result.estimate.device_total_bytes <= 0.95 * p.budget_bytes  # the default 5% headroom
    assert p.per_device_train_batch_size * p.gradient_accumulation_steps * s.dp_size == rec.global_batch_size
    assert (s.seq_len, s.num_gpus, s.load_in_4bit, s.lora_r) == (rec.seq_len, rec.num_gpus, rec.load_in_4bit, rec.lora_r)
    assert s.task == rec.task


def test_dry_run_needs_zero_where_model_states_cannot_fit(capsys):
    # GPT-2-XL: fp32 weights + gradients alone are 1.56e9 x 8 B = 11.6 GiB, over 12 GiB less headroom.
    gpt2 = execute(recipe("gpt2xl_12gb"), ["--dry-run"]).plan.settings
    assert gpt2.zero_stage >= 2 and gpt2.offload_optimizer == "cpu"
    # Llama-2-70B: 280 GB of fp32 weights alone; only ZeRO-3 partitions parameters over the 8 GPUs.
    assert execute(recipe("llama2_70b_8x80gb"), ["--dry-run"]).plan.settings.zero_stage == 3
    # LoRA plans for the bf16 base the recipe loads; QLoRA for its 4-bit base with bf16 compute.
    assert execute(recipe("mistral7b_lora_16gb"), ["--dry-run"]).plan.settings.precision == "bf16"
    assert execute(recipe("llama31_8b_qlora_24gb"), ["--dry-run"]).plan.settings.precision == "bf16-mixed"


def test_dry_run_on_two_nodes(capsys):
    one = execute(recipe("llama2_70b_8x80gb"), ["--dry-run"])
    two = execute(recipe("llama2_70b_8x80gb"), ["--dry-run", "--num-nodes", "2"])
    assert re.search(r"^GPUs +8 x 2 node\(s\)$", capsys.readouterr().out, re.MULTILINE)
    p = two.plan
    assert (p.num_gpus, p.num_nodes, p.settings.world_size) == (8, 2, 16)
    assert p.per_device_train_batch_size * p.gradient_accumulation_steps * 16 == 64
    assert p.settings.zero_stage == 3
    # Twice the ranks hold half the sharded model states each.
    assert two.estimate.cpu_bytes + two.estimate.device_total_bytes < one.estimate.cpu_bytes + one.estimate.device_total_bytes


def test_dry_run_flags_override_the_recipe(capsys):
    result = execute(recipe("gpt2xl_12gb"), ["--dry-run", "--memory_budget", "80GiB", "--global-batch-size", "32"])
    assert result.plan.budget_bytes == 80 * GiB
    assert result.plan.per_device_train_batch_size * result.plan.gradient_accumulation_steps == 32


# --- --smoke -----------------------------------------------------------------------------

@pytest.fixture(scope="module")
def smoke(tmp_path_factory):
    """name -> (trained MemFitTrainer, output dir); each recipe's smoke runs once for all tests."""
    runs = {}

    def get(name):
        if name not in runs:
            out = tmp_path_factory.mktemp(name) / "out"
            runs[name] = execute(recipe(name), ["--smoke", "--output_dir", str(out)]), out
        return runs[name]

    return get


def _base(trainer):
    return getattr(trainer.model, "get_base_model", lambda: trainer.model)()


@pytest.mark.parametrize("name", RECIPES)
def test_smoke_trains_the_planned_configuration(name, smoke):
    trainer, out = smoke(name)
    plan = trainer.memfit_plan
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    assert trainer.state.global_step == 3 and len(losses) == 3
    assert all(math.isfinite(loss) for loss in losses)
    # The smoke budget only has room for micro-batch 2 without checkpointing, so the plan
    # must accumulate, as the real plans do; the trainer runs with the plan's knobs.
    assert plan.gradient_accumulation_steps >= 2
    assert plan.per_device_train_batch_size * plan.gradient_accumulation_steps == 8
    assert (trainer.args.per_device_train_batch_size, trainer.args.gradient_accumulation_steps, trainer.args.optim) == \
           (plan.per_device_train_batch_size, plan.gradient_accumulation_steps, plan.optim)
    saved = json.loads((out / "memfit_plan.json").read_text())
    assert saved["plan"]["gradient_accumulation_steps"] == plan.gradient_accumulation_steps
    # A tiny model of the recipe's own family, from a local checkpoint.
    assert _base(trainer).config.model_type == resolve_model(recipe(name).model).model_type
    assert _base(trainer).config.num_hidden_layers == 2


@pytest.mark.parametrize("name", RECIPES)
def test_smoke_loads_the_model_as_the_real_run(name, smoke):
    trainer, _ = smoke(name)
    rec, base = recipe(name), _base(trainer)
    trainable = [p for p in trainer.model.parameters() if p.requires_grad]
    if rec.load_in_4bit:
        import bitsandbytes as bnb

        # QLoRA on the CPU with bitsandbytes' real NF4 Linear4bit, planned as 4-bit.
        linear4 = [m for m in base.modules() if isinstance(m, bnb.nn.Linear4bit)]
        storage = 2 if rec.shard_4bit else 1  # bf16 quant storage where FSDP shards the 4-bit weights, else uint8
        assert linear4 and all(m.weight.dtype.itemsize == storage and m.weight.quant_type == "nf4" for m in linear4)
        assert trainer.memfit_plan.settings.load_in_4bit and trainer.memfit_plan.bf16
    if rec.lora_r or rec.load_in_4bit:
        assert trainable and all("lora_" in n for n, p in trainer.model.named_parameters() if p.requires_grad)
        assert sum(p.numel() for p in trainable) < 0.5 * sum(p.numel() for p in trainer.model.parameters())
    else:  # full fine-tuning: fp32 master weights, every parameter trains
        assert all(p.requires_grad and str(p.dtype) == "torch.float32" for p in trainer.model.parameters())
    if rec.lora_r and not rec.load_in_4bit:  # the frozen LoRA base in bf16, as the dry run plans it
        assert str(base.get_input_embeddings().weight.dtype) == "torch.bfloat16"
        assert trainer.memfit_plan.settings.precision == "bf16"


def test_smoke_classification_loss_is_not_scaled_by_accumulation(smoke):
    # Two balanced classes from an untrained head: a mean cross-entropy near ln 2, not k x ln 2
    # (transformers 5.23 skips the division by the accumulation steps for BERT; recipe.py works around it).
    trainer, _ = smoke("bert_large_cls_8gb")
    assert trainer.memfit_plan.gradient_accumulation_steps >= 2
    first = next(h["loss"] for h in trainer.state.log_history if "loss" in h)
    assert abs(first - math.log(2)) < 0.1


@pytest.mark.parametrize("name", RECIPES)
def test_smoke_measured_peak_is_near_the_prediction(name, smoke):
    trainer, _ = smoke(name)
    check = next(h for h in trainer.state.log_history if "memfit/relative_error" in h)
    assert abs(check["memfit/relative_error"]) < 0.25, check


def test_planned_checkpointing_reaches_the_model(smoke):
    trainer, _ = smoke("gpt2xl_12gb")
    if not trainer.memfit_plan.gradient_checkpointing:
        pytest.skip("the smoke plan did not turn checkpointing on")
    assert trainer.args.activation_checkpointing and _base(trainer).is_activation_checkpointing


def test_smoke_reads_train_file(tmp_path, capsys):
    text = tmp_path / "labelled.tsv"
    text.write_text("".join(f"{i % 2}\tsentence number {i} says {'plan' if i % 2 else 'data'}\n" for i in range(64)))
    trainer = execute(recipe("bert_large_cls_8gb"), ["--smoke", "--train-file", str(text), "--max_steps", "1",
                                                     "--output_dir", str(tmp_path / "out")])
    assert trainer.state.global_step == 1
    assert len(trainer.train_dataset) == 64 and sorted(set(trainer.train_dataset["labels"])) == [0, 1]
    assert "smoke run passed: 1 steps" in capsys.readouterr().out


def test_script_runs_as_a_subprocess(tmp_path):
    """The entry point users type, from another directory: it leaves nothing behind there."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    done = subprocess.run([sys.executable, str(REPO / "recipes" / "gpt2xl_12gb.py"), "--smoke"], cwd=tmp_path,
                          env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    summary = re.search(r"smoke run passed: 3 steps of micro-batch (\d+) x accumulation (\d+).*output in (\S+) \(removed\)",
                        done.stdout)
    assert summary and int(summary[1]) * int(summary[2]) == 8, done.stdout[-2000:]
    assert not Path(summary[3]).exists() and list(tmp_path.iterdir()) == []
    assert "Traceback" not in done.stderr


# --- user errors: one line, exit code 2 ---------------------------------------------------------

@pytest.mark.parametrize("argv, message", [
    (["--train-file", "missing.txt"], "`--train-file missing.txt` is not a file"),
    (["--dry-run", "--smoke"], "`--dry-run` and `--smoke` exclude each other"),
    (["--dry-run", "--num-nodes", "0"], "`--num-nodes` must be a positive integer"),
    (["--dry-run", "--memory_budget", "twelve"], "`memory_budget` got 'twelve'"),
    (["--dry-run", "--global-batch-size", "63", "--num-nodes", "2"], "`--global-batch-size 63` cannot be split"),
    (["--dry-run", "--bogus", "1"], "unknown argument(s) --bogus 1: see `--help`"),
])
def test_bad_input_is_one_line_and_exit_code_2(argv, message, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    name = "llama2_70b_8x80gb" if "--num-nodes" in argv else "gpt2xl_12gb"
    assert run(recipe(name), argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("recipe: error: ") and message in err, err
    assert list(tmp_path.iterdir()) == []


def test_bad_classification_file_is_caught_before_loading(tmp_path, capsys):
    bad = tmp_path / "bad.tsv"
    bad.write_text("1\tgood line\nno label here\n7\tlabel out of range\n")
    assert run(recipe("bert_large_cls_8gb"), ["--train-file", str(bad), "--output_dir", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "line 2 'no label here'" in err and "line 3" in err and "below 2" in err


def test_unloadable_model_is_one_line(tmp_path, capsys):
    # The real-run path, offline: the model cannot be fetched. (A made-up id, so no cache can hold it.)
    import dataclasses

    text = tmp_path / "text.txt"
    text.write_text("some words\n" * 10)
    missing = dataclasses.replace(recipe("gpt2xl_12gb"), model="hf-memfit-tests/no-such-model")
    assert run(missing, ["--train-file", str(text), "--output_dir", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "cannot load `hf-memfit-tests/no-such-model`" in err and "--smoke" in err


# --- README table, accelerate configs, Dockerfile -------------------------------------------------

def test_readme_recipes_table_is_current():
    readme = (REPO / "README.md").read_text(encoding="utf-8")
    table = readme_table()
    # header, rule, one row each, + the 70B on 2 nodes and GPT-2-XL on a 16 GB-RAM machine
    assert len(table.splitlines()) == 2 + len(RECIPES) + 2
    assert readme_with_table(readme, table) == readme, \
        "README.md's recipes table is stale: run `python -m hf_memfit.integrations.recipe --update-readme` and commit README.md"
    with pytest.raises(MemFitError, match="markers"):
        readme_with_table("# no table here\n", table)


def test_accelerate_configs_load_in_accelerate():
    from accelerate.commands.config.config_args import ClusterConfig

    paths = {p.stem: p for p in (REPO / "recipes" / "accelerate").glob("*.yaml")}
    assert set(paths) == {"single_gpu", "ddp", "deepspeed_zero3", "fsdp", "fsdp_qlora_offload"}
    configs = {name: ClusterConfig.from_yaml_file(str(path)) for name, path in paths.items()}
    assert {name: c.distributed_type.value for name, c in configs.items()} == {
        "single_gpu": "NO", "ddp": "MULTI_GPU", "deepspeed_zero3": "DEEPSPEED", "fsdp": "FSDP",
        "fsdp_qlora_offload": "FSDP"}
    assert configs["deepspeed_zero3"].deepspeed_config["zero_stage"] == 3
    assert configs["single_gpu"].num_processes == 1


def test_recipe_docstrings_name_files_that_exist():
    for name in RECIPES:
        doc = load_recipe_module(REPO / "recipes" / f"{name}.py").__doc__
        named = re.findall(r"recipes/[\w/.-]+\.(?:py|yaml)", doc)
        assert f"recipes/{name}.py" in named
        assert all((REPO / path).is_file() for path in named), (name, named)


def test_dockerfile_installs_real_extras_and_copies_real_paths():
    tomllib = pytest.importorskip("tomllib")
    extras = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    lines = [line.strip() for line in (REPO / "Dockerfile").read_text().replace("\\\n", " ").splitlines()
             if line.strip() and not line.lstrip().startswith("#")]
    base = next(line.split()[1] for line in lines if line.startswith("FROM "))
    assert re.fullmatch(r"pytorch/pytorch:\d+\.\d+\.\d+-cuda12\.\d+-cudnn9-devel", base)  # devel: nvcc for flash-attn
    copied = [source for line in lines if line.startswith("COPY ") for source in line.split()[1:-1]]
    assert copied and all((REPO / source).exists() for source in copied), copied
    assert {"pyproject.toml", "README.md", "hf_memfit", "recipes"} <= set(copied)  # install + `docker run` needs
    install = next(line for line in lines if re.search(r"pip install .*\"\.\[", line))
    asked = set(re.search(r"\"\.\[([\w,-]+)\]\"", install)[1].split(","))
    assert asked == {"deepspeed", "bnb", "flash", "recipes"} and asked <= set(extras)  # recipes: datasets
    assert "--no-build-isolation" in install  # flash-attn's setup.py imports torch


def test_training_without_datasets_names_the_extra(tmp_path, monkeypatch, capsys):
    """`datasets` is the `recipes` extra: without it, one line naming the extra, before anything is built."""
    monkeypatch.setitem(sys.modules, "datasets", None)  # `import datasets` now raises ImportError
    monkeypatch.chdir(tmp_path)
    assert run(recipe("gpt2xl_12gb"), ["--smoke"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and 'pip install "hf-memfit[recipes]"' in err, err
    assert list(tmp_path.iterdir()) == []


def test_the_package_imports_without_datasets():
    """Only training a recipe needs `datasets`: every hf_memfit module imports without it.

    Except `hf_memfit.integrations.trl`, whose `trl` package (the `trl` extra) itself requires `datasets`, and
    `hf_memfit.cli.__main__`, which runs the command when imported (`python -m hf_memfit.cli`).
    """
    script = ("import importlib, pkgutil, sys\n"
              "sys.modules['datasets'] = None\n"
              "import hf_memfit\n"
              "for module in pkgutil.walk_packages(hf_memfit.__path__, 'hf_memfit.'):\n"
              "    if module.name != 'hf_memfit.integrations.trl' and not module.name.endswith('.__main__'):\n"
              "        importlib.import_module(module.name)\n")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": str(REPO)})
    assert done.returncode == 0, done.stderr[-2000:]


def test_smoke_fails_when_the_run_does_not_learn(tmp_path, monkeypatch, capsys):
    """A smoke run passes only if it trained (it was reported passed while its loss rose): here nothing moves."""
    monkeypatch.chdir(tmp_path)
    assert run(recipe("gpt2xl_12gb"), ["--smoke", "--learning_rate", "0"]) == 1
    err = capsys.readouterr().err
    assert "smoke run failed: no trainable parameter changed in 3 steps" in err, err
    assert list(tmp_path.iterdir()) == []


def test_smoke_language_model_loss_must_decrease():
    """For language models the loss on the fixed batch must go down; a higher or equal one fails the run."""
    from types import SimpleNamespace

    from hf_memfit.integrations.recipe import SmokeFailure, _smoke_summary

    trainer = SimpleNamespace(memfit_plan=None, state=SimpleNamespace(global_step=3, log_history=[{"loss": 5.0}]),
                              args=SimpleNamespace(max_steps=3))
    with pytest.raises(SmokeFailure, match=r"did not decrease: 5\.0000 -> 5\.0100"):
        _smoke_summary(trainer, 5.0, 5.01, changed=4, trainable=4)
    with pytest.raises(SmokeFailure, match="no trainable parameter changed"):
        _smoke_summary(trainer, 5.0, 4.0, changed=0, trainable=4)


def test_smoke_probe_leaves_4bit_training_intact(smoke):
    """The before/after probe must not stop QLoRA from training (an eval-mode forward repacks bitsandbytes'
    4-bit weights on AVX512-BF16 CPUs, after which the adapters got no gradients): every step has a gradient."""
    trainer, _ = smoke("llama31_8b_qlora_24gb")
    norms = [h["grad_norm"] for h in trainer.state.log_history if "grad_norm" in h]
    assert len(norms) == 3 and all(norm > 0 for norm in norms), norms


def test_70b_qlora_recipe_shards_4bit_weights_with_fsdp(capsys):
    """Llama-2-70B QLoRA on 2 x 24 GB: FSDP full_shard + CPU offload, the shipped accelerate config is the plan's."""
    import yaml

    from hf_memfit.planner.accelerate import accelerate_fsdp_config

    result = execute(recipe("llama2_70b_qlora_2x24gb"), ["--dry-run"])
    s = result.plan.settings
    assert (s.fsdp, s.fsdp_version, s.fsdp_offload, s.load_in_4bit) == ("full_shard", 2, True, True)
    assert s.bnb_4bit_quant_storage == "bfloat16"
    assert result.estimate.cpu_bytes > 15 * GiB  # a 1/2 shard of ~35 GB of 4-bit weights, per GPU
    shipped = yaml.safe_load((REPO / "recipes" / "accelerate" / "fsdp_qlora_offload.yaml").read_text())
    assert shipped == accelerate_fsdp_config(s)
