"""`hf-memfit explain`: the timeline agrees with exact mode, phases are ordered, the plot is drawn."""

import pytest

from hf_memfit.cli import main
from hf_memfit.estimator import assemble
from hf_memfit.settings import TrainSettings
from hf_memfit.timeline import trace_timeline
from hf_memfit.trace import exact_candidates


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
