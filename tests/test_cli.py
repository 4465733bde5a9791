"""The `hf-memfit` command: contract of --json, readable tables, and one-line errors with exit code 2."""

import json
import subprocess
import sys

import pytest

from hf_memfit.cli.main import main


def run_cli(capsys, *argv) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_estimate_json_contract(capsys):
    code, out, _ = run_cli(capsys, "estimate", "gpt2", "--batch-size", "2", "--seq-len", "128", "--json")
    assert code == 0
    data = json.loads(out)
    for key in ("peak_allocated_bytes", "peak_reserved_bytes", "device_total_bytes", "cpu_bytes", "nvme_bytes"):
        assert isinstance(data[key], int) and data[key] >= 0
    assert set(data["breakdown"]) == {"weights", "gradients", "optimizer", "activations", "temporary", "overhead"}
    assert sum(data["breakdown"].values()) == data["device_total_bytes"]
    assert data["peak_allocated_bytes"] <= data["peak_reserved_bytes"] <= data["device_total_bytes"]


def test_cpu_peaks_are_equal(capsys):
    code, out, _ = run_cli(capsys, "estimate", "gpt2", "--batch-size", "1", "--seq-len", "64", "--device", "cpu", "--json")
    data = json.loads(out)
    assert code == 0
    assert data["peak_allocated_bytes"] == data["peak_reserved_bytes"] == data["device_total_bytes"]


def test_estimate_table_is_readable(capsys):
    code, out, _ = run_cli(capsys, "estimate", "meta-llama/Llama-3.1-8B", "--batch-size", "1", "--seq-len", "512",
                           "--precision", "bf16-mixed", "--lora-r", "8")
    assert code == 0
    assert "activations" in out and "GiB" in out and "nvidia-smi" in out


def test_offload_moves_bytes_to_the_host(capsys):
    args = ["estimate", "gpt2-xl", "--batch-size", "1", "--seq-len", "512", "--precision", "bf16-mixed", "--json"]
    _, out, _ = run_cli(capsys, *args, "--zero-stage", "2")
    on_gpu = json.loads(out)
    _, out, _ = run_cli(capsys, *args, "--zero-stage", "2", "--offload-optimizer", "cpu")
    offloaded = json.loads(out)
    assert offloaded["cpu_bytes"] > 0 and on_gpu["cpu_bytes"] == 0
    assert offloaded["device_total_bytes"] < on_gpu["device_total_bytes"]


BAD_INPUTS = [
    # checked before the trace, not after it: /proc takes no new folders
    (["explain", "gpt2", "--batch-size", "1", "--seq-len", "8", "--plot", "/proc/nonexistent/x.png"], "--plot"),
    (["estimate", "gpt2-xxl", "--batch-size", "1", "--seq-len", "8"], "gpt2-xl"),  # unknown model: suggests close names
    (["estimate", "gpt2", "--batch-size", "1", "--seq-len", "4096"], "--seq-len"),
    (["estimate", "gpt2", "--batch-size", "1", "--seq-len", "8", "--optim", "adamw_magic"], "--optim"),
    # not key=value pairs: the Trainer's own parse fails on it (a traceback from inside a trace before)
    (["estimate", "gpt2", "--batch-size", "1", "--seq-len", "8", "--optim", "adamw_torch_4bit", "--optim-args",
      "bf16_stochastic_round"], "--optim-args"),
    # pairs the Trainer passes on as strings, which torchao's AdamW fails on at its first step, in the real run too
    (["estimate", "gpt2", "--batch-size", "1", "--seq-len", "8", "--optim", "adamw_torch_4bit", "--optim-args",
      "block_size=128", "--mode", "exact", "--precision", "bf16"], "--optim-args"),
    (["estimate", "gpt2", "--batch-size", "1", "--seq-len", "8", "--lora-r", "8", "--lora-target-modules", "q_proj"],
     "--lora-target-modules"),
    (["estimate", "gpt2", "--batch-size", "0", "--seq-len", "8"], "--batch-size"),
    (["estimate", "gpt2", "--batch-size", "-2", "--seq-len", "8"], "--batch-size"),
    (["estimate", "gpt2", "--batch-size", "1", "--seq-len", "8", "--offload-param", "cpu"], "zero-stage"),
    (["estimate", "gpt2", "--batch-size", "1", "--seq-len", "8", "--lora-alpha", "16"], "--lora-r"),
    (["estimate", "gpt2", "--batch-size", "1", "--seq-len", "8", "--gpu", "gtx-9999"], "--gpu"),
    (["plan", "gpt2", "--seq-len", "128", "--global-batch-size", "6", "--num-gpus", "4", "--gpu-memory", "16GiB"],
     "--global-batch-size"),
    (["plan", "gpt2", "--seq-len", "128", "--global-batch-size", "8", "--gpu-memory", "12 parsecs"], "--gpu-memory"),
    (["estimate", "gpt2", "--batch-size", "1"], "--seq-len"),
    # sizes beyond any device: a typo that would make every plan fit (1e400 is inf to float())
    (["plan", "gpt2", "--seq-len", "128", "--global-batch-size", "8", "--gpu-memory", "1e30GiB"], "64.00 TiB"),
    (["plan", "gpt2", "--seq-len", "128", "--global-batch-size", "8", "--gpu-memory", "1e400GiB"], "--gpu-memory"),
    (["plan", "gpt2", "--seq-len", "128", "--global-batch-size", "8", "--gpu-memory", "65TiB"], "--gpu-memory"),
    (["plan", "gpt2", "--seq-len", "128", "--global-batch-size", "8", "--gpu-memory", "12GiB", "--cpu-memory",
      "1e30GiB"], "--cpu-memory"),
    (["estimate", "gpt2", "--batch-size", "1", "--max-length", "64", "--packing"], "--trainer sft"),
    (["estimate", "gpt2", "--batch-size", "1", "--seq-len", "64", "--max-length", "32", "--trainer", "sft"],
     "--max-length"),
    (["estimate", "gpt2", "--batch-size", "1", "--seq-len", "64", "--reference-model", "copy"], "--trainer dpo"),
    (["estimate", "gpt2", "--batch-size", "1", "--seq-len", "64", "--trainer", "dpo", "--reference-model",
      "adapters"], "--lora-r"),
]


@pytest.mark.parametrize("argv,named", BAD_INPUTS, ids=[" ".join(a[1:3]) + f" [{n}]" for a, n in BAD_INPUTS])
def test_bad_input_is_one_line_with_exit_code_2(capsys, argv, named):
    code, out, err = run_cli(capsys, *argv)
    assert code == 2
    assert err.count("\n") == 1 and err.startswith("hf-memfit: error:")
    assert named in err
    assert "Traceback" not in err


def test_size_limit_is_inclusive_and_covers_every_caller():
    from hf_memfit.errors import MemFitError
    from hf_memfit.integrations.args import MemFitArguments
    from hf_memfit.units import MAX_MEMORY_BYTES, parse_bytes

    assert parse_bytes("64TiB") == MAX_MEMORY_BYTES  # the limit itself is still a size
    for too_big in (MAX_MEMORY_BYTES + 1, float("inf"), float("nan"), "64.001TiB"):
        with pytest.raises(MemFitError, match="`--x`"):
            parse_bytes(too_big, "--x")
    with pytest.raises(MemFitError, match="memory_budget"):  # the Trainer's field parses through the same place
        MemFitArguments(output_dir="/tmp/unused", memory_budget="1e30GiB")


def test_real_process_exit_code_and_no_traceback():
    proc = subprocess.run([sys.executable, "-m", "hf_memfit.cli", "estimate", "llama-3-8b", "--batch-size", "1",
                           "--seq-len", "8"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr
    assert "meta-llama/Llama-3" in proc.stderr  # close catalogue matches


def test_the_command_exits_without_teardown_but_with_its_output_and_exit_handlers():
    # `run()` (the `hf-memfit` command) ends with os._exit, skipping Python's 1.2 s teardown after a trace: the
    # whole JSON still reaches a pipe, and the exit handlers libraries registered still run.
    code = ("import atexit, sys; atexit.register(lambda: print('exit handlers ran', file=sys.stderr)); "
            "sys.argv = ['hf-memfit', 'plan', 'gpt2', '--gpu-memory', '12GiB', '--seq-len', '128', "
            "'--global-batch-size', '8', '--json']; from hf_memfit.cli import run; run()")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert json.loads(proc.stdout)["plan"]["per_device_train_batch_size"] >= 1
    assert "exit handlers ran" in proc.stderr


def test_fast_cli_path_does_not_import_torch():
    code = ("import sys; from hf_memfit.cli.main import main; main(['estimate','gpt2','--batch-size','1','--seq-len','64',"
            "'--json']); assert 'torch' not in sys.modules, 'torch imported'")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr


def test_closed_pipe_ends_quietly():
    # `hf-memfit plan ... | head -1` with a reader that is already gone: no traceback, exit 141 as Unix tools do.
    import os

    read_end, write_end = os.pipe()
    os.close(read_end)  # nobody will ever read: the first write fails with EPIPE
    proc = subprocess.run([sys.executable, "-m", "hf_memfit.cli", "plan", "gpt2", "--gpu-memory", "12GiB",
                           "--seq-len", "128", "--global-batch-size", "8"], stdout=write_end, stderr=subprocess.PIPE,
                          text=True)
    os.close(write_end)
    assert proc.returncode == 141
    assert "Traceback" not in proc.stderr and "BrokenPipe" not in proc.stderr


def test_version_prints_the_package_version(capsys):
    import hf_memfit

    with pytest.raises(SystemExit) as exit_:
        main(["--version"])
    assert exit_.value.code == 0
    assert capsys.readouterr().out == f"hf-memfit {hf_memfit.__version__}\n"


def test_progress_shows_on_a_terminal_at_once_and_elsewhere_after_a_second():
    import io
    import logging

    from hf_memfit.cli.main import _ProgressOnStderr

    class Terminal(io.StringIO):
        def isatty(self):
            return True

    now = [100.0]
    record = logging.LogRecord("hf_memfit.progress", logging.INFO, __file__, 1, "tracing %s", ("gpt2",), None)
    piped, terminal = io.StringIO(), Terminal()
    piped_handler = _ProgressOnStderr(piped, clock=lambda: now[0])
    terminal_handler = _ProgressOnStderr(terminal, clock=lambda: now[0])
    now[0] = 100.4  # a quick command: nothing in a log, the line on a terminal
    piped_handler.emit(record)
    terminal_handler.emit(record)
    assert piped.getvalue() == "" and terminal.getvalue() == "hf-memfit: [0 s] tracing gpt2 ...\n"
    now[0] = 103.0  # a slow one: shown everywhere
    piped_handler.emit(record)
    assert piped.getvalue() == "hf-memfit: [3 s] tracing gpt2 ...\n"


def test_exact_mode_progress_goes_to_stderr_never_into_json(capsys, monkeypatch, tmp_path):
    from hf_memfit.cli.main import _ProgressOnStderr

    monkeypatch.setattr(_ProgressOnStderr, "QUIET_SECONDS", 0.0)  # a tiny model traces in well under a second
    config = tmp_path / "config.json"
    config.write_text(json.dumps(dict(model_type="gpt2", n_layer=6, n_embd=32, n_head=2, vocab_size=128,
                                      n_positions=64)))
    code, out, err = run_cli(capsys, "estimate", str(config), "--batch-size", "1", "--seq-len", "16",
                             "--mode", "exact", "--json")
    assert code == 0 and json.loads(out)["mode"] == "exact"
    lines = [line for line in err.splitlines() if line.startswith("hf-memfit: [")]
    assert len(lines) == 2, err  # traced at depths 2 and 3, extrapolated to 6
    assert "depth 2 (1 of 2), extrapolated to 6" in lines[0] and "depth 3 (2 of 2)" in lines[1]


def test_plan_for_sft_prints_the_config_fields(capsys):
    argv = ["plan", "Qwen/Qwen2.5-0.5B", "--gpu-memory", "16GiB", "--trainer", "sft", "--max-length", "2048",
            "--packing", "--global-batch-size", "16"]
    code, out, _ = run_cli(capsys, *argv)
    assert code == 0
    assert "MemFitSFTConfig(" in out and "packing=True," in out and "max_length=2048," in out
    code, out, _ = run_cli(capsys, *argv, "--json")
    data = json.loads(out)
    plan = data["plan"]
    fields = data["trl_config"]
    assert fields["per_device_train_batch_size"] == plan["per_device_train_batch_size"]
    assert fields["gradient_accumulation_steps"] == plan["gradient_accumulation_steps"]
    assert fields["padding_free"] is True and fields["memory_budget"] == "16GiB"
    assert data["estimate"]["settings"]["trainer"] == "sft" and data["estimate"]["settings"]["padding_free"]


def test_trl_step_costs_what_its_head_keeps(capsys):
    """TRL's fused head never builds the [b, s, vocab] logits the plain Trainer's loss keeps: a large-vocab model
    needs far less, and DPO (chosen + rejected rows, a reference copy) more than SFT."""
    base = ["estimate", "Qwen/Qwen2.5-0.5B", "--batch-size", "4", "--seq-len", "2048", "--precision", "bf16-mixed",
            "--json"]
    need = {}
    for trainer in ("trainer", "sft", "dpo"):
        code, out, _ = run_cli(capsys, *base, "--trainer", trainer)
        assert code == 0
        need[trainer] = json.loads(out)["peak_allocated_bytes"]
    logits = 4 * 2048 * 151936 * 4  # one fp32 copy of the logits
    assert need["trainer"] - need["sft"] > logits
    assert need["dpo"] > need["sft"]


def test_stdout_holds_only_the_result_when_a_library_prints_to_it(capsys, monkeypatch):
    """DeepSpeed's logger reports its accelerator on stdout when transformers or bitsandbytes first import it
    mid-run, which broke `check --json` (stdout began with a `[WARNING]` line). Whatever a library prints while a
    command runs goes to stderr; stdout carries the JSON alone."""
    import hf_memfit.models.spec as spec_module

    resolve = spec_module.resolve_model

    def chatty_resolve(*args, **kwargs):
        print("[WARNING] [real_accelerator.py:213:get_accelerator] Setting accelerator to CPU.")
        return resolve(*args, **kwargs)

    monkeypatch.setattr(spec_module, "resolve_model", chatty_resolve)
    assert main(["estimate", "gpt2", "--batch-size", "1", "--seq-len", "128", "--mode", "fast", "--json"]) == 0
    out, err = capsys.readouterr()
    assert json.loads(out)["peak_allocated_bytes"] > 0
    assert "Setting accelerator to CPU" in err
