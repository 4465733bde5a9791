"""`hf-memfit explain`: the timeline agrees with exact mode, phases are ordered, the plot is drawn."""

import shlex

import pytest

from hf_memfit.cli.main import main
from hf_memfit.estimator.assemble import assemble
from hf_memfit.settings import TrainSettings
from hf_memfit.estimator.timeline import trace_timeline
from hf_memfit.estimator.exact import exact_candidates


def test_timeline_peak_equals_exact_mode(tiny_specs):
    spec = tiny_specs["llama"]
    settings = TrainSettings(batch_size=2, seq_len=32, device="cpu", mode="exact").validate(spec)
    timeline = trace_timeline(spec, settings)
    exact = assemble(spec, settings, exact_candidates(spec, settings))
    assert abs(timeline.peak_bytes - exact.peak_allocated_bytes) <= 0.001 * exact.peak_allocated_bytes
    assert sum(timeline.peak_breakdown.values()) == timeline.peak_bytes
    assert max(timeline.total) == timeline.peak_bytes  # down-sampling keeps the peak


def test_phases_are_in_order(tiny_specs):
    spec = tiny_specs["gpt2"]
    timeline = trace_timeline(spec, TrainSettings(batch_size=1, seq_len=16, device="cpu").validate(spec))
    names = [p.name for p in timeline.phases]
    assert names == ["step 1 forward", "step 1 backward", "step 1 optimizer step",
                     "step 2 forward", "step 2 backward", "step 2 optimizer step"]
    assert all(a.end == b.start for a, b in zip(timeline.phases, timeline.phases[1:]))
    assert all(p.start < p.end for p in timeline.phases)
    assert timeline.top_modules and timeline.top_modules[0][1] > 0


def test_explain_plot_and_compare(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    path = tmp_path / "where.png"
    code = main(["explain", "gpt2", "--batch-size", "1", "--seq-len", "64", "--device", "cpu", "--plot", str(path),
                 "--compare", "gradient_checkpointing=true"])
    out = capsys.readouterr().out
    assert code == 0
    assert "step 2 backward" in out and "Live at the peak" in out
    assert path.stat().st_size > 20_000  # a drawn chart, not an empty canvas
    from PIL import Image

    image = Image.open(path).convert("L")
    colors = len(set(image.getdata()))
    assert colors > 50


def test_checkpointing_lowers_the_traced_peak(tiny_specs):
    spec = tiny_specs["gpt2"]
    base = TrainSettings(batch_size=4, seq_len=64, device="cpu").validate(spec)
    plain = trace_timeline(spec, base)
    ckpt = trace_timeline(spec, base.replace(gradient_checkpointing=True))
    assert ckpt.peak_breakdown["activations"] < plain.peak_breakdown["activations"]


def test_compare_rejects_unknown_fields(capsys):
    code = main(["explain", "gpt2", "--batch-size", "1", "--seq-len", "16", "--compare", "warp_drive=on"])
    assert code == 2
    assert "--compare" in capsys.readouterr().err


def test_phases_name_the_micro_batches(tiny_specs):
    spec = tiny_specs["gpt2"]
    settings = TrainSettings(batch_size=1, seq_len=16, gradient_accumulation_steps=4, device="cpu").validate(spec)
    names = [p.name for p in trace_timeline(spec, settings).phases][:5]
    assert names == ["step 1 forward, micro-batch 1", "step 1 backward, micro-batch 1",
                     "step 1 forward, micro-batches 2-4", "step 1 backward, micro-batches 2-4", "step 1 optimizer step"]


PLANS = [
    ["gpt2-xl", "--gpu-memory", "12GiB", "--seq-len", "1024", "--global-batch-size", "64"],  # ZeRO-2 + offload
    ["meta-llama/Llama-3.1-8B", "--gpu", "a10g", "--seq-len", "2048", "--global-batch-size", "32", "--load-in-4bit",
     "--lora-r", "16"],
    ["bert-base-uncased", "--gpu-memory", "2GiB", "--seq-len", "128", "--global-batch-size", "32", "--device", "cpu"],
    ["Qwen/Qwen2.5-0.5B", "--gpu-memory", "12GiB", "--seq-len", "1024", "--global-batch-size", "32"],  # one GPU
]


@pytest.mark.parametrize("argv", PLANS, ids=lambda argv: argv[0])
def test_plan_table_gives_the_explain_command_of_its_plan(argv):
    from hf_memfit.cli.arguments import settings_from_args
    from hf_memfit.cli.main import build_parser
    from hf_memfit.planner.search import plan
    from hf_memfit.report.text import explain_command, format_plan

    args = build_parser().parse_args(["plan", *argv])
    result = plan(args.model, seq_len=args.seq_len, global_batch_size=args.global_batch_size,
                  gpu_memory=args.gpu_memory, gpu=args.gpu, lora_r=args.lora_r, load_in_4bit=args.load_in_4bit,
                  device=args.device)
    command = explain_command(result.estimate.model, result.plan.settings)
    assert command in format_plan(result)
    parsed = build_parser().parse_args(command.split()[1:])  # round trip: the command describes the plan's step
    traced = settings_from_args(parsed).validate()
    plan_settings = result.plan.settings
    for field in ("batch_size", "seq_len", "gradient_accumulation_steps", "precision", "optim", "gradient_checkpointing",
                  "lora_r", "load_in_4bit", "zero_stage", "offload_optimizer", "offload_param", "device", "gpu",
                  "attn_implementation"):
        assert getattr(traced, field) == getattr(plan_settings, field), field
    # a plan on one GPU the run simulation covers also prints `estimate --vary-seq-len` for its step (the others
    # here: ZeRO-2, a 4-bit base, the CPU), and that command parses
    from hf_memfit.estimator.run_of_shapes import run_problems

    varying = [line.strip() for line in format_plan(result).splitlines() if "--vary-seq-len" in line]
    shortest = plan_settings.seq_len // 8
    simulated = plan_settings.device == "cuda" and not run_problems(plan_settings, min_seq_len=shortest,
                                                                      micro_batches=64)
    assert len(varying) == (1 if simulated else 0), varying
    if varying:
        assert build_parser().parse_args(varying[0].split()[1:]).vary_seq_len == shortest == 128


def test_plan_explain_traces_the_chosen_plan(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    path = tmp_path / "plan.png"
    code = main(["plan", "gpt2", "--gpu-memory", "3GiB", "--seq-len", "256", "--global-batch-size", "16", "--device",
                 "cpu", "--explain", str(path), "--json"])
    data = __import__("json").loads(capsys.readouterr().out)
    assert code == 0 and path.stat().st_size > 20_000
    # the traced step is the plan's: its peak is exact mode's estimate of the same settings (CPU: allocated == total)
    from hf_memfit.estimator.assemble import estimate

    plan = data["plan"]
    exact = estimate("gpt2", batch_size=plan["per_device_train_batch_size"],
                     gradient_accumulation_steps=plan["gradient_accumulation_steps"], seq_len=256, device="cpu",
                     optim=plan["optim"], gradient_checkpointing=plan["gradient_checkpointing"], mode="exact")
    assert abs(data["explain"]["peak_bytes"] - exact.peak_allocated_bytes) <= 0.001 * exact.peak_allocated_bytes


@pytest.mark.parametrize("layout", [dict(zero_stage=2, num_gpus=4), dict(zero_stage=3, num_gpus=4),
                                    dict(zero_stage=3, num_gpus=2, offload_optimizer="cpu"), dict(num_gpus=2)],
                         ids=["zero2", "zero3", "zero3-offload", "ddp"])
def test_timeline_draws_one_rank_as_the_estimate_computes_it(tiny_specs, layout):
    """Issue 12 item 9: explain drew the unsharded step for a ZeRO plan (12.56 GiB drawn for a 10.54 GiB plan)."""
    from hf_memfit.estimator.assemble import estimate_settings, traced_settings

    spec = tiny_specs["llama"]
    settings = TrainSettings(batch_size=2, seq_len=32, device="cuda", gpu="a100", precision="bf16-mixed",
                             mode="exact", **layout).validate(spec)
    timeline = trace_timeline(spec, settings)
    # The estimator on the same full-depth trace: the drawn peak is its peak allocated, to the byte.
    same_trace = assemble(spec, settings, exact_candidates(spec, traced_settings(settings), extrapolate=False))
    assert timeline.peak_bytes == same_trace.peak_allocated_bytes
    # Its allocator replay (reserved, hence nvidia-smi) is of a second trace of the same step, whose release
    # order can differ by a garbage collection: equal up to a few KiB.
    assert abs(timeline.device_total_bytes - same_trace.device_total_bytes) <= 0.001 * same_trace.device_total_bytes
    assert sum(timeline.peak_breakdown.values()) == timeline.peak_bytes == max(timeline.total)
    # ... and what `estimate`/`plan` print (depth-extrapolated exact, closed-form fast) agree with it.
    for mode, tolerance in (("exact", 0.001), ("fast", 0.02)):
        printed = estimate_settings(spec, settings.replace(mode=mode)).peak_allocated_bytes
        assert abs(timeline.peak_bytes - printed) <= tolerance * printed, (mode, timeline.peak_bytes, printed)
    if settings.zero_stage:  # the rank holds less than the one-device step would
        single = trace_timeline(spec, settings.replace(zero_stage=0, num_gpus=1, offload_optimizer="none"))
        assert timeline.peak_breakdown["optimizer"] < single.peak_breakdown["optimizer"] or \
            timeline.peak_bytes < single.peak_bytes
        assert "per rank: ZeRO-" in timeline.label


@pytest.mark.parametrize("fields", [
    dict(batch_size=4, seq_len=None, task="ctc", audio_seconds=12.5, label_len=80, frozen=("wav2vec2.feature_extractor",),
         precision="bf16-mixed", gradient_checkpointing=True, gpu="a10g"),
    dict(batch_size=2, seq_len=512, task="image-text-to-text", image_size=672, images_per_sample=2, lora_r=16,
         lora_target_regex=r".*language_model.*\.(q_proj|v_proj)", load_in_4bit=True, bnb_4bit_use_double_quant=False, bnb_4bit_quant_storage="bfloat16",
         prepare_model_for_kbit_training=False, frozen=("vision_tower",), precision="bf16-mixed", zero_stage=3,
         num_gpus=2),
    dict(batch_size=1, seq_len=2048, ssm_kernels="torch", gradient_accumulation_steps=8, optim="adamw_bnb_8bit"),
], ids=["ctc", "vlm-qlora", "ssm"])
def test_the_printed_estimate_command_is_the_same_step(fields):
    """A plan prints the `hf-memfit estimate` command of its step: parsed back, it gives the same settings, inputs,
    frozen modules, 4-bit options and kernel path included (an audio plan's command once lacked `--audio-seconds`)."""
    from hf_memfit.cli.arguments import settings_from_args
    from hf_memfit.cli.main import build_parser
    from hf_memfit.report.text import step_command

    settings = TrainSettings(**fields, mode="fast")
    command = step_command("estimate", "some/model", settings)
    parsed = settings_from_args(build_parser().parse_args(shlex.split(command)[1:]))  # as a shell splits it
    assert parsed.to_dict() == settings.to_dict(), command
