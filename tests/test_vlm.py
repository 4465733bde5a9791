"""Vision-language models (issue 18): Qwen2.5-VL's image grid in the fake trace, and TRL's SFTTrainer on a VLM."""

import numpy as np
import pytest
import torch
from transformers import AutoConfig

from hf_memfit.cli.main import main
from hf_memfit.estimator.assemble import estimate_settings
from hf_memfit.estimator.measure import measure_cpu_peak
from hf_memfit.models.spec import ModelSpec
from hf_memfit.settings import TrainSettings

QWEN25VL = dict(model_type="qwen2_5_vl", hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                num_attention_heads=2, num_key_value_heads=2, vocab_size=512, image_token_id=511, video_token_id=510,
                vision_start_token_id=509, vision_end_token_id=508, bos_token_id=1, eos_token_id=2,
                rope_scaling={"type": "mrope", "mrope_section": [4, 6, 6]},
                vision_config=dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64,
                                   patch_size=14, spatial_merge_size=2, temporal_patch_size=2, window_size=56,
                                   fullatt_block_indexes=[1]))


def qwen_spec():
    return ModelSpec.from_config("tiny-qwen2.5-vl", AutoConfig.for_model(**QWEN25VL).to_dict())


def test_qwen25_vl_traces_its_image_grid_and_matches_the_measured_step():
    # 112 px -> 8 x 8 patches of 14 px: four 28-px windows (window_size 56), 16 LM tokens per image
    spec = qwen_spec()
    settings = TrainSettings(batch_size=2, seq_len=16, task="image-text-to-text", device="cpu", mode="exact",
                             image_size=112)
    exact = estimate_settings(spec, settings)
    assert "16 tokens each" in exact.notes[0]
    measured = measure_cpu_peak(spec.config, exact.settings)
    assert exact.peak_allocated_bytes == pytest.approx(measured, rel=0.01)
    fast = estimate_settings(spec, settings.replace(mode="fast"))
    assert fast.peak_allocated_bytes == pytest.approx(exact.peak_allocated_bytes, rel=0.02)


IDEFICS3 = dict(model_type="idefics3", image_token_id=511, scale_factor=2,
                text_config=dict(model_type="llama", hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                 num_attention_heads=2, num_key_value_heads=2, vocab_size=512),
                vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                                   image_size=64, patch_size=16))


def test_idefics3_reads_its_pixels_and_matches_the_measured_step():
    # a 128-px image in 64-px tiles: 2 x 2 tiles + the global view, (64 / 16)^2 / 2^2 = 4 tokens each
    config = AutoConfig.for_model(**IDEFICS3).to_dict()
    config["memfit_processor"] = {"size": {"longest_edge": 128}, "max_image_size": {"longest_edge": 64}}
    spec = ModelSpec.from_config("tiny-idefics3", config)
    settings = TrainSettings(batch_size=2, seq_len=16, task="image-text-to-text", device="cpu", mode="exact")
    exact = estimate_settings(spec, settings)
    assert "20 tokens each (5 tiles)" in exact.notes[0]
    assert exact.peak_allocated_bytes == pytest.approx(measure_cpu_peak(spec.config, exact.settings), rel=0.01)


def test_a_vlm_fit_moves_the_optimizer_by_formula_over_the_parameters_it_steps(tmp_path, monkeypatch):
    """LLaVA reads the second-to-last CLIP layer, so the last one gets no gradient and AdamW makes no state for it.
    The fit's optimizer formula counts only the parameters a backward reached: it then matches the trace, and one
    fit serves the low-bit optimizers (before, each was traced again: 12 of a cold LLaVA-1.5 plan's 17 fits)."""
    from hf_memfit.estimator import batch_fit
    from hf_memfit.estimator.assemble import fit_group

    monkeypatch.setenv("HF_MEMFIT_CACHE", str(tmp_path))
    spec = ModelSpec.from_config("tiny-llava", AutoConfig.for_model(**LLAVA).to_dict())
    settings = TrainSettings(batch_size=2, seq_len=32, task="image-text-to-text", device="cuda", gpu="A100",
                             precision="bf16-mixed", optim="adamw_torch")
    estimate_settings(spec, settings)
    group = fit_group(spec, settings.replace(mode="fast"))  # "batch:" + the fit's cache key
    assert batch_fit._read(group.removeprefix("batch:"))["optimizer_formula_exact"]
    calls = []
    original = batch_fit.calibrate_many
    monkeypatch.setattr(batch_fit, "calibrate_many", lambda *a, **k: calls.append(a) or original(*a, **k))
    for optim in ("adamw_bnb_8bit", "adamw_torch_4bit"):
        fast = estimate_settings(spec, settings.replace(batch_size=3, optim=optim))
        exact = estimate_settings(spec, settings.replace(batch_size=3, optim=optim, mode="exact"))
        assert fast.peak_allocated_bytes == pytest.approx(exact.peak_allocated_bytes, rel=0.01), optim
    assert not calls


def test_a_line_whose_check_point_is_traced_apart_is_the_same_line(monkeypatch):
    """Three depth sets on two CPUs: the base depth's check point is traced in a build of its own (`check_apart`),
    so a fit's four jobs pair up. The line is the same, region by region, as with the check inside the base trace,
    and so is the check it reports (each traced step starts from the warm-up's state)."""
    from hf_memfit.estimator import batch_fit
    from hf_memfit.models.depths import depth_plan

    config = AutoConfig.for_model(**dict(LLAVA, text_config=dict(LLAVA["text_config"], num_hidden_layers=6),
                                         vision_config=dict(LLAVA["vision_config"], num_hidden_layers=7))).to_dict()
    spec = ModelSpec.from_config("tiny-llava-6", config)
    assert len(depth_plan(spec).depth_sets) == 3
    settings = TrainSettings(batch_size=1, seq_len=32, task="image-text-to-text", device="cuda", gpu="A100",
                             precision="bf16-mixed", gradient_checkpointing=True).validate(spec)
    fits = {}
    for apart in (False, True):
        monkeypatch.setattr(batch_fit, "check_apart", lambda depth_sets, apart=apart: apart)
        (fits[apart],) = batch_fit.calibrate_many(spec, [settings])
    assert fits[True]["candidates"] == fits[False]["candidates"] and fits[True]["host"] == fits[False]["host"]
    assert fits[True]["check_miss"] == pytest.approx(fits[False]["check_miss"], abs=1e-6)
    assert fits[True]["check_region"] == fits[False]["check_region"]


def test_real_metadata_mode_keeps_floats_fake_and_integers_real():
    from torch._subclasses.fake_tensor import FakeTensor

    from hf_memfit.estimator.trace import StorageTracker
    from hf_memfit.estimator.trace_mode import TraceFakeTensorMode

    tracker = StorageTracker()
    tracker.real_integers = True  # as a trace of a VLM that reads its batch sets it
    with TraceFakeTensorMode(allow_non_fake_inputs=True), tracker:
        grid = torch.tensor([[1, 4, 6]])
        lengths = (grid[:, 1] * grid[:, 2]).tolist()  # a value the vision code reads
        index = torch.arange(24).reshape(4, 6)
        selected = index[index % 2 == 0]  # a boolean selection: a shape from the values
        hidden = torch.randn(24, 8)
        gathered = hidden[selected]  # fake activations, indexed by real integers
    assert lengths == [24] and selected.shape == (12,) and not isinstance(selected, FakeTensor)
    assert isinstance(hidden, FakeTensor) and isinstance(gathered, FakeTensor) and gathered.shape == (12, 8)


def test_a_vlm_trace_that_reads_its_batch_sums_gradients_in_place_as_any_trace(monkeypatch):
    """Autograd's engine sums two gradients of one tensor in place when its buffer holds the only reference
    (`StorageTracker._engine_sums_in_place`, by reference counts). A dispatch mode of its own for the real-integer
    rules held one more reference to every argument, so in such a trace no sum was ever taken as in place."""
    from hf_memfit.estimator import trace
    from hf_memfit.estimator.exact import trace_step
    from hf_memfit.models.depths import config_with_depths, real_depths

    taken = []
    original = trace.StorageTracker._engine_sums_in_place
    monkeypatch.setattr(trace.StorageTracker, "_engine_sums_in_place",
                        lambda self, args, kwargs: taken.append(original(self, args, kwargs)) or taken[-1])
    spec = qwen_spec()
    settings = TrainSettings(batch_size=2, seq_len=16, task="image-text-to-text", device="cuda", gpu="A100",
                             mode="exact", image_size=112).validate(spec)
    depths = real_depths(spec)
    trace_step(config_with_depths(spec, depths), settings, depths)
    assert sum(taken) >= 10  # 38 of its 84 gradient additions are the engine's sums in place (none before)


# --- TRL's SFTTrainer with its vision collator ---------------------------------------------------------

LLAVA = dict(model_type="llava", image_token_index=511, image_seq_length=16,
             text_config=dict(model_type="llama", hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                              num_attention_heads=2, num_key_value_heads=2, vocab_size=512),
             vision_config=dict(model_type="clip_vision_model", hidden_size=32, intermediate_size=64,
                                num_hidden_layers=2, num_attention_heads=2, image_size=64, patch_size=16,
                                projection_dim=32))


def llava_processor():
    """LLaVA's processor built offline: CLIP's image processor at 64 px and a word-level tokenizer with <image>."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import CLIPImageProcessor, LlavaProcessor, PreTrainedTokenizerFast

    words = Tokenizer(models.WordLevel({"<pad>": 0, "<unk>": 1, **{f"w{i}": i for i in range(2, 500)},
                                        "<image>": 511}, unk_token="<unk>"))
    words.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=words, pad_token="<pad>", unk_token="<unk>",
                                        extra_special_tokens={"image_token": "<image>"})
    return LlavaProcessor(CLIPImageProcessor(size={"shortest_edge": 64}, crop_size={"height": 64, "width": 64}),
                          tokenizer, patch_size=16, vision_feature_select_strategy="default",
                          num_additional_image_tokens=1, image_token="<image>")


@pytest.mark.slow  # trains two TRL steps after planning (two batch-fit calibrations): about 40 s of CPU
def test_sft_trainer_plans_a_vlm_from_its_vision_collator(tmp_path):
    from datasets import Dataset
    from PIL import Image
    from transformers import AutoModelForImageTextToText

    from hf_memfit.integrations.trl import MemFitSFTConfig, MemFitSFTTrainer

    g = np.random.default_rng(0)
    words = lambda n: " ".join(f"w{int(i)}" for i in g.integers(2, 500, n))  # noqa: E731
    data = Dataset.from_list([{"images": [Image.fromarray(g.integers(0, 255, (80, 80, 3), dtype=np.uint8))],
                               "prompt": "<image> " + words(8), "completion": words(24)} for _ in range(4)])
    torch.manual_seed(0)
    model = AutoModelForImageTextToText.from_config(AutoConfig.for_model(**LLAVA))
    args = MemFitSFTConfig(output_dir=str(tmp_path / "out"), memory_budget="4GiB", per_device_train_batch_size=2,
                           max_steps=2, report_to=[], save_strategy="no", use_cpu=True, logging_steps=1,
                           disable_tqdm=True, bf16=False, max_length=None)
    trainer = MemFitSFTTrainer(model=model, args=args, train_dataset=data, processing_class=llava_processor())
    settings = trainer.memfit_result.estimate.settings
    # 16 image tokens per row (64 px / 16-px patches) are not text: 8 + 24 text tokens
    assert (settings.task, settings.trainer, settings.images_per_sample, settings.seq_len) == \
        ("image-text-to-text", "sft", 1, 32)
    trainer.train()
    checks = [h for h in trainer.state.log_history if "memfit/relative_error" in h]
    assert checks and abs(checks[0]["memfit/relative_error"]) < 0.05


def test_cli_image_size_on_a_vlm_planned_as_text_names_the_task_and_exits_2(capsys):
    from hf_memfit.cli.main import main

    # Gemma-3's class is its image-text class, but without `--task` it is planned as a causal LM
    assert main(["estimate", "google/gemma-3-4b-it", "--batch-size", "1", "--seq-len", "64", "--image-size", "448"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "add `--task image-text-to-text`" in err
    assert main(["estimate", "google/gemma-3-4b-it", "--task", "image-text-to-text", "--batch-size", "1",
                 "--seq-len", "64", "--image-size", "448"]) == 2
    assert "resizes every image to 896 px" in capsys.readouterr().err


# --- LLaVA-NeXT: any-resolution tiles ---------------------------------------------------------------------

LLAVA_NEXT = dict(model_type="llava_next", image_token_index=511, image_grid_pinpoints=[[32, 64], [64, 32], [64, 64]],
                  text_config=dict(model_type="mistral", hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=2, num_key_value_heads=2, vocab_size=512),
                  vision_config=dict(model_type="clip_vision_model", hidden_size=32, intermediate_size=64,
                                     num_hidden_layers=2, num_attention_heads=2, image_size=32, patch_size=8,
                                     projection_dim=32))


def llava_next_processor():
    """LLaVA-NeXT's processor built offline: its PIL image processor (the default one needs torchvision, not
    installed here) in 32-px tiles, and a word-level tokenizer with <image>."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlavaNextProcessor, PreTrainedTokenizerFast
    from transformers.models.llava_next.image_processing_pil_llava_next import LlavaNextImageProcessorPil

    words = Tokenizer(models.WordLevel({"<pad>": 0, "<unk>": 1, **{f"w{i}": i for i in range(2, 500)},
                                        "<image>": 511}, unk_token="<unk>"))
    words.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=words, pad_token="<pad>", unk_token="<unk>",
                                        extra_special_tokens={"image_token": "<image>"})
    images = LlavaNextImageProcessorPil(size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32},
                                        image_grid_pinpoints=LLAVA_NEXT["image_grid_pinpoints"])
    return LlavaNextProcessor(images, tokenizer, patch_size=8, vision_feature_select_strategy="default",
                              num_additional_image_tokens=1, image_token="<image>")


def test_llava_next_tiles_as_its_processor_does_and_matches_the_measured_step():
    from PIL import Image

    from hf_memfit.models.vision_language import image_layout

    config = AutoConfig.for_model(**LLAVA_NEXT).to_dict()
    processor = llava_next_processor()
    # 20 px: the 32 x 64 pinpoint (1 x 2 tiles), unpadded to 4 x 4 features; 48 and 100 px: 64 x 64 (2 x 2 tiles);
    # each with 4 x 4 base features and a newline per row
    for side, tokens in ((20, 4 * 4 + 4 + 16), (48, 8 * 8 + 8 + 16), (100, 8 * 8 + 8 + 16)):
        image = Image.fromarray(np.zeros((side, side, 3), dtype=np.uint8))
        made = processor(images=[image], text=["<image> w2 w3"], return_tensors="pt")
        layout = image_layout(config, side)
        assert int((made["input_ids"] == 511).sum()) == layout["tokens"] == tokens
        assert tuple(made["pixel_values"].shape[1:]) == layout["pixels"]
        assert made["image_sizes"].tolist() == [list(layout["image_sizes"])]
    # the model reads `image_sizes` (.tolist()) while it traces: kept real, as Qwen's image grid is
    spec = ModelSpec.from_config("tiny-llava-next", config)
    settings = TrainSettings(batch_size=2, seq_len=16, task="image-text-to-text", device="cpu", mode="exact",
                             image_size=48)
    exact = estimate_settings(spec, settings)
    assert "88 tokens each (4 tiles of 64x64 px + the base image)" in exact.notes[0]
    # fast mode (batch_fit, a line fitted to these traces) is left to benchmarks/modalities.py's llava-next rows:
    # it would double this test's time
    assert exact.peak_allocated_bytes == pytest.approx(measure_cpu_peak(spec.config, exact.settings), rel=0.01)


def test_llava_next_pinpoints_it_cannot_tile_exit_2_with_one_line(tmp_path, capsys):
    import json

    from hf_memfit.cli.main import main

    config = AutoConfig.for_model(**{**LLAVA_NEXT, "image_grid_pinpoints": [[32, 64], [48, 48]]}).to_dict()
    (tmp_path / "config.json").write_text(json.dumps(config))
    assert main(["estimate", str(tmp_path / "config.json"), "--task", "image-text-to-text", "--batch-size", "1",
                 "--seq-len", "16"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "[[48, 48]] are not multiples of the vision tower's 32-px tile" in err


def test_lora_on_the_language_model_only_by_a_regex(capsys):
    """peft's `target_modules` as a regex (TRL's VLM recipes train LoRA on the language model only): the trace
    trains exactly what peft wraps, fast mode equals exact, the trainer reads the regex off the adapter, and a
    pattern that matches nothing, or does not compile, is one line and exit 2."""
    from peft import LoraConfig, get_peft_model

    from hf_memfit.integrations.introspect import lora_settings
    from hf_memfit.models.build import instantiate

    config = AutoConfig.for_model(**LLAVA).to_dict()
    spec = ModelSpec.from_config("tiny-llava", config)
    regex = r".*language_model.*\.(q_proj|v_proj)"
    settings = TrainSettings(batch_size=2, seq_len=16, task="image-text-to-text", device="cpu", lora_r=4,
                             lora_target_regex=regex)
    exact = estimate_settings(spec, settings.replace(mode="exact"))
    peft_model = get_peft_model(instantiate(config, "image-text-to-text", 2, dtype=torch.float32,
                                            attn_implementation="sdpa"),
                                LoraConfig(r=4, target_modules=regex))
    assert exact.trainable_params == sum(p.numel() for p in peft_model.parameters() if p.requires_grad)
    assert exact.trainable_params < estimate_settings(spec, settings.replace(
        mode="exact", lora_target_regex=None, lora_target_modules=("q_proj", "v_proj"))).trainable_params  # + tower
    assert estimate_settings(spec, settings).peak_allocated_bytes == pytest.approx(exact.peak_allocated_bytes, rel=0.02)
    assert lora_settings(peft_model)["target_regex"] == regex
    from hf_memfit.errors import MemFitError

    with pytest.raises(MemFitError, match="matches no module"):
        estimate_settings(spec, settings.replace(mode="exact", lora_target_regex=r".*vision_model.*\.nothing"))
    code = main(["estimate", "llava-hf/llava-1.5-7b-hf", "--task", "image-text-to-text", "--seq-len", "16",
                 "--batch-size", "1", "--lora-r", "4", "--lora-target-regex", "(q_proj"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and "not a regular expression" in err[0], err
    # LoRA with no targets on a model type peft has no default for: peft would raise mid-trace; one line here
    code = main(["plan", "llava-hf/llava-1.5-7b-hf", "--task", "image-text-to-text", "--seq-len", "16",
                 "--global-batch-size", "1", "--gpu", "a10g", "--lora-r", "4"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and "no default LoRA target modules for model type `llava`" in err[0], err


def test_catalogue_image_tokens_are_inside_the_text_vocabulary():
    """A real step embeds the image placeholder ids before replacing them (`get_input_embeddings()(input_ids)`):
    an id past the text vocabulary is a device-side assert on a GPU. The SmolVLM entry carried SmolVLM2's 49190
    (its vocabulary is 49,155) until an H100 check failed on it; fake tensors never index, so no trace saw it."""
    import glob
    import json
    import os

    from transformers import AutoConfig

    import hf_memfit

    folder = os.path.join(os.path.dirname(hf_memfit.__file__), "catalogue")
    checked = 0
    for path in sorted(glob.glob(os.path.join(folder, "*.json"))):
        with open(path, encoding="utf-8") as f:
            fields = {k: v for k, v in json.load(f).items() if not k.startswith("_")}
        token = fields.get("image_token_id", fields.get("image_token_index"))
        if token is None:
            continue
        config = AutoConfig.for_model(**fields)
        vocab = config.get_text_config().vocab_size
        assert 0 <= token < vocab, (os.path.basename(path), token, vocab)
        checked += 1
    assert checked >= 5  # Qwen2.5-VL, three Gemma-3, two LLaVA, SmolVLM
