"""OOM recovery under DeepSpeed ZeRO-2/ZeRO-3 (one process) and FSDP2 (2 processes over gloo), on the CPU.

Each case launches one script that trains a fault-free run and the faulty ones of the same tiny
GPT-2, so that weights can be compared (`tests/scripts/train_deepspeed_oom.py`,
`tests/scripts/train_fsdp2_oom.py`). A micro-batch that is lost or counted twice moves the
weights by about the learning rate (1e-3) nearly everywhere; chunked gradients differ from whole
ones by float rounding, which Adam can amplify only where a gradient is near zero.
"""

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from hf_memfit.integrations.recovery import largest_fitting_chunk, resume_command

SCRIPTS = Path(__file__).resolve().parent / "scripts"
ROOT = SCRIPTS.parent.parent


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _assert_same_training(weights: dict, clean: dict) -> None:
    diff = torch.cat([(weights[name] - value).abs().flatten() for name, value in clean.items()])
    assert diff.max() < 1e-4, f"max weight difference {diff.max():.2e}"
    assert (diff > 2e-6).float().mean() < 1e-3, f"{int((diff > 2e-6).sum())} of {diff.numel()} weights moved"


@pytest.mark.slow
@pytest.mark.parametrize("stage", [2, 3])
def test_deepspeed_stops_to_resume_after_a_backward_oom_and_redoes_a_forward_oom_in_place(stage, tmp_path):
    pytest.importorskip("deepspeed")
    env = os.environ | {"DS_ACCELERATOR": "cpu", "RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0",
                        "LOCAL_WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port()),
                        "PYTHONWARNINGS": "ignore"}
    proc = subprocess.run([sys.executable, str(SCRIPTS / "train_deepspeed_oom.py"), "--stage", str(stage),
                           str(tmp_path)], env=env, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    result = {name: json.loads((tmp_path / f"{name}.json").read_text()) for name in ("clean", "backward", "resumed")}
    weights = {name: torch.load(tmp_path / f"{name}.pt") for name in result}
    assert {r["layout"] for r in result.values()} == {"deepspeed"} and result["clean"]["global_step"] == 3
    # backward: chunks of 4 after a forward OOM, then stopped in a backward at the start of step 1,
    # with the next rung in the checkpoint and the command that resumes
    stopped = result["backward"]
    checkpoint = tmp_path / "backward" / "checkpoint-1"
    assert stopped["switches"] == ["micro-batch split into chunks of 4"] and stopped["global_step"] == 1
    assert f"Saved {checkpoint} with the next rung (chunks of 2" in stopped["error"]
    assert f"--resume_from_checkpoint {checkpoint}" in stopped["error"]
    saved = json.loads((checkpoint / "memfit_resume.json").read_text())
    assert saved["next"]["micro_batch_chunk"] == 2 and saved["command"].endswith(str(checkpoint))
    assert json.loads((checkpoint / "memfit_state.json").read_text())["micro_batch_chunk"] == 2
    assert (weights["backward"]["transformer.wte.weight"] - weights["clean"]["transformer.wte.weight"]).abs().max() > 1e-4
    # resumed in chunks of 2; a forward OOM with two chunks already reduced went on in chunks of 1, in place
    resumed = result["resumed"]
    assert (resumed["chunk"], resumed["recoveries"], resumed["global_step"]) == (1, 3, 3)
    _assert_same_training(weights["resumed"], weights["clean"])


@pytest.mark.slow
def test_fsdp2_ranks_agree_on_one_ranks_oom_and_redo_the_step(tmp_path):
    command = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2",
               "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no",
               "--main_process_port", str(_free_port()), str(SCRIPTS / "train_fsdp2_oom.py"), str(tmp_path)]
    proc = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=600)
    files = sorted(tmp_path.glob("*-rank*.json"))
    assert proc.returncode == 0 and len(files) == 4, (proc.stdout + proc.stderr)[-4000:]
    results = {(r["run"], r["rank"]): r for r in (json.loads(path.read_text()) for path in files)}
    rank0, rank1 = results[("forward", 0)], results[("forward", 1)]
    assert rank0["layout"] == rank1["layout"] == "fsdp2" and rank0["sharded"] and rank0["world_size"] == 2
    # the OOM was on rank 1 only; both ranks stepped down together
    assert rank0["switches"] == rank1["switches"] and rank0["recoveries"] == rank1["recoveries"] == 3
    assert rank0["chunk"] == rank1["chunk"] == 1 and rank0["global_step"] == rank1["global_step"] == 3
    clean = torch.load(tmp_path / "clean-rank0.pt")
    weights = [torch.load(tmp_path / f"forward-rank{rank}.pt") for rank in (0, 1)]
    for name, value in weights[0].items():
        torch.testing.assert_close(weights[1][name], value, rtol=0, atol=0, msg=name)  # lockstep
    _assert_same_training(weights[0], clean)


@pytest.mark.slow
def test_fsdp2_a_rank_that_cannot_be_joined_stops_and_takes_the_others_with_it(tmp_path):
    command = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2",
               "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no",
               "--main_process_port", str(_free_port()), str(SCRIPTS / "train_fsdp2_oom.py"), str(tmp_path), "alone"]
    proc = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode != 0  # the launch fails: no rank trained on
    error = (tmp_path / "alone-rank1-error.txt").read_text()
    assert "backward pass under fsdp2" in error and "cannot be redone in place" in error
    assert "train_fsdp2_oom.py" in error and "--nproc_per_node 2" in error  # the command that resumes
    assert not list(tmp_path.glob("alone-rank*.json"))  # neither rank finished training


def test_resume_command_replaces_the_checkpoint_and_names_the_launcher(monkeypatch):
    monkeypatch.setattr(sys, "argv", ["train.py", "--memory_budget", "24GiB", "--resume_from_checkpoint", "old"])
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    assert resume_command("out/checkpoint-7") == ("torchrun --nnodes 2 --nproc_per_node 2 train.py --memory_budget "
                                                  "24GiB --resume_from_checkpoint out/checkpoint-7")
    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.setattr(sys, "argv", ["my script.py", "--resume_from_checkpoint=old"])
    assert resume_command(None).endswith("'my script.py'")


def test_the_next_chunk_is_replanned_from_the_measured_overshoot():
    from hf_memfit.estimator.assemble import estimate

    def total(chunk):
        return estimate("gpt2", batch_size=chunk, seq_len=512, gpu="a100").device_total_bytes

    usable = total(8)  # the plan's micro-batch of 8 filled the budget, and the step needed 1.5x its estimate
    chunk = largest_fitting_chunk(8, 1.5, total, usable)
    assert 1 < chunk < 8 and total(chunk) * 1.5 <= usable < total(chunk + 1) * 1.5
    assert largest_fitting_chunk(8, 1.0, total, usable) == 7  # no overshoot: the next smaller chunk fits
    assert largest_fitting_chunk(8, 100.0, total, usable) == 1  # nothing fits: the ladder's last chunk
