"""Vision, audio, speech and vision-language models (issue 18): tiny models built from configs, on the CPU."""

import json
import logging

import pytest
import torch
from transformers import AutoConfig, AutoModelForImageClassification, AutoModelForMaskedLM, AutoModelForSpeechSeq2Seq

from hf_memfit.errors import MemFitError
from hf_memfit.estimator.assemble import estimate_settings
from hf_memfit.estimator.measure import measure_cpu_peak
from hf_memfit.integrations.args import MemFitArguments
from hf_memfit.integrations.trainer import MemFitSeq2SeqTrainer, MemFitSeq2SeqTrainingArguments, MemFitTrainer
from hf_memfit.models.spec import ModelSpec
from hf_memfit.settings import TrainSettings

VIT = dict(model_type="vit", hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
           image_size=32, patch_size=8, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
WHISPER = dict(model_type="whisper", d_model=32, encoder_layers=2, decoder_layers=2, encoder_attention_heads=2,
               decoder_attention_heads=2, encoder_ffn_dim=64, decoder_ffn_dim=64, vocab_size=128, num_mel_bins=16,
               max_source_positions=1500, max_target_positions=32, pad_token_id=0, bos_token_id=1, eos_token_id=2,
               decoder_start_token_id=1, dropout=0.0)
WAV2VEC2 = dict(model_type="wav2vec2", hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
                conv_dim=[16] * 7, num_conv_pos_embeddings=16, num_conv_pos_embedding_groups=2, vocab_size=32,
                hidden_dropout=0.0, attention_dropout=0.0, feat_proj_dropout=0.0, activation_dropout=0.0)


def config(**fields) -> dict:
    return AutoConfig.for_model(**fields).to_dict()


class Rows(torch.utils.data.Dataset):
    def __init__(self, make, n=8):
        generator = torch.Generator().manual_seed(0)
        self.rows = [make(generator) for _ in range(n)]

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        return self.rows[i]


def args(tmp_path, cls=MemFitArguments, **overrides):
    values = dict(output_dir=str(tmp_path / "out"), memory_budget="4GiB", per_device_train_batch_size=2,
                  max_steps=2, report_to=[], save_strategy="no", use_cpu=True, logging_steps=1, disable_tqdm=True)
    values.update(overrides)
    return cls(**values)


# --- the estimator -----------------------------------------------------------------------------------

# wav2vec2's convolutional front end on raw samples: the CPU's conv1d kernels allocate im2col / reorder
# buffers inside the kernel (a Conv1d(1, 16, 10, 5) step: 624 KB on the profiler, 206 KB of tensors), which
# no dispatch-level count sees; in this tiny model they are a tenth of the step (docs/benchmarks.md, 15).
@pytest.mark.parametrize("fields,task,inputs,tolerance", [
    (VIT, "image-cls", {}, 0.05),
    (WAV2VEC2, "audio-cls", {"audio_seconds": 0.5}, 0.15),
    (WHISPER, "speech-seq2seq", {"label_len": 12}, 0.05),
    (WAV2VEC2, "ctc", {"audio_seconds": 0.5, "label_len": 6}, 0.15),  # the loss: estimator/fake_ctc.py
])
def test_exact_and_fast_agree_with_the_measured_step(fields, task, inputs, tolerance):
    spec = ModelSpec.from_config("tiny", config(**fields))
    base = TrainSettings(batch_size=2, seq_len=None, task=task, device="cpu", **inputs)
    exact = estimate_settings(spec, base.replace(mode="exact"))
    fast = estimate_settings(spec, base.replace(mode="fast"))
    measured = measure_cpu_peak(spec.config, exact.settings)
    assert exact.peak_allocated_bytes == pytest.approx(measured, rel=tolerance)
    assert fast.peak_allocated_bytes == pytest.approx(exact.peak_allocated_bytes, rel=0.02)
    assert any(note.startswith("inputs:") for note in exact.notes)


def test_an_image_size_a_fixed_size_model_refuses_is_one_line():
    spec = ModelSpec.from_config("tiny-vit", config(**VIT))
    with pytest.raises(MemFitError, match="takes 32x32 images only"):
        TrainSettings(batch_size=1, seq_len=None, task="image-cls", image_size=64).validate(spec)


def test_audio_past_whisper_window_and_labels_past_its_positions():
    spec = ModelSpec.from_config("tiny-whisper", config(**WHISPER))
    with pytest.raises(MemFitError, match="past tiny-whisper's 30 s window.*label-len 33"):
        TrainSettings(batch_size=1, seq_len=None, task="speech-seq2seq", audio_seconds=31, label_len=33).validate(spec)


def test_whisper_task_advice_names_what_transformers_builds():
    spec = ModelSpec.from_config("tiny-whisper", config(**WHISPER))
    with pytest.raises(MemFitError, match="use one of causal-lm, audio-cls, speech-seq2seq"):
        TrainSettings(batch_size=1, seq_len=8, task="seq2seq").validate(spec)


def test_a_task_the_model_does_not_do_is_the_whole_error():
    """ViT asked for CTC: the error names the tasks it does, and asks for no audio length, which would not help."""
    spec = ModelSpec.from_config("tiny-vit", config(**VIT))
    with pytest.raises(MemFitError) as refusal:
        TrainSettings(batch_size=1, seq_len=None, task="ctc").validate(spec)
    assert "`--task ctc` is not available for vit models; use one of image-cls" in str(refusal.value)
    assert "--audio-seconds" not in str(refusal.value)


def test_hub_pipeline_tags_name_the_same_tasks(capsys):
    """A model page's pipeline tag works as `--task`: speech recognition is CTC or sequence-to-sequence by the model,
    and a tag no task of the model answers is the one-line refusal, naming the tag as given."""
    from hf_memfit.cli.main import main

    vit = ModelSpec.from_config("tiny-vit", config(**VIT))
    whisper = ModelSpec.from_config("tiny-whisper", config(**WHISPER))
    wav2vec2 = ModelSpec.from_config("tiny-wav2vec2", config(**WAV2VEC2))
    asr = "automatic-speech-recognition"
    assert TrainSettings(batch_size=1, seq_len=None, task="image-classification").validate(vit).task == "image-cls"
    assert TrainSettings(batch_size=1, seq_len=None, task=asr, audio_seconds=2).validate(whisper).task == "speech-seq2seq"
    assert TrainSettings(batch_size=1, seq_len=None, task=asr, audio_seconds=2).validate(wav2vec2).task == "ctc"
    assert TrainSettings(batch_size=1, seq_len=8, task=asr).validate().task == asr  # resolved once the model is known
    tagged = estimate_settings(vit, TrainSettings(batch_size=2, seq_len=None, task="image-classification"))
    named = estimate_settings(vit, TrainSettings(batch_size=2, seq_len=None, task="image-cls"))
    assert tagged.settings.task == "image-cls" and tagged.device_total_bytes == named.device_total_bytes
    with pytest.raises(MemFitError, match="`--task automatic-speech-recognition` is not available for vit models"):
        TrainSettings(batch_size=1, seq_len=None, task=asr).validate(vit)
    with pytest.raises(MemFitError, match="Hub pipeline tag"):
        TrainSettings(batch_size=1, seq_len=8, task="image-segmentation").validate()
    assert main(["estimate", "gpt2", "--batch-size", "1", "--seq-len", "64", "--task", asr]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "`--task automatic-speech-recognition` is not available for gpt2" in err


def test_vlm_image_tokens_follow_the_processor_rules():
    from hf_memfit.models.vision_language import image_layout, smart_resize

    # Qwen2-VL: 28-px multiples within [min, max] pixels; 448 px -> 32 x 32 patches -> 256 tokens
    assert smart_resize(448, 448, 28, 3136, 12845056) == (448, 448)
    qwen = {"vision_config": {"patch_size": 14, "spatial_merge_size": 2},
            "memfit_processor": {"min_pixels": 3136, "max_pixels": 200704}}
    layout = image_layout(qwen, 1000)  # capped by max_pixels: 448 x 448
    assert layout["resized"] == (448, 448) and layout["tokens"] == 256 and layout["pixels"] == (1024, 1176)
    gemma3 = image_layout({"mm_tokens_per_image": 256, "vision_config": {"image_size": 896}}, None)
    assert (gemma3["tokens"], gemma3["extra"], gemma3["pixels"]) == (256, 2, (3, 896, 896))  # + begin / end of image
    llava = {"image_token_index": 32000, "vision_config": {"image_size": 336, "patch_size": 14}}
    assert image_layout(llava, None)["tokens"] == 576


# --- the trainers ------------------------------------------------------------------------------------

def test_a_model_hf_memfit_cannot_estimate_trains_unplanned_with_one_warning(tmp_path, caplog):
    torch.manual_seed(0)
    model = AutoModelForMaskedLM.from_config(AutoConfig.for_model(
        "bert", hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64, vocab_size=64))
    data = Rows(lambda g: {"input_ids": torch.randint(0, 64, (16,), generator=g),
                           "labels": torch.randint(0, 64, (16,), generator=g)})
    with caplog.at_level(logging.WARNING):
        trainer = MemFitTrainer(model=model, args=args(tmp_path), train_dataset=data)
    warnings = [r.getMessage() for r in caplog.records if "cannot estimate" in r.getMessage()]
    assert len(warnings) == 1 and "BertForMaskedLM" in warnings[0] and "as given" in warnings[0]
    assert trainer.memfit_result is None and trainer.args.per_device_train_batch_size == 2  # the user's arguments
    output = trainer.train()
    assert output.global_step == 2 and torch.isfinite(torch.tensor(output.training_loss))


def test_a_budget_nothing_fits_is_still_refused(tmp_path):
    torch.manual_seed(0)
    model = AutoModelForImageClassification.from_config(AutoConfig.for_model(**VIT))
    data = Rows(lambda g: {"pixel_values": torch.randn(3, 32, 32, generator=g), "labels": 1})
    with pytest.raises(MemFitError, match="nothing fits"):
        MemFitTrainer(model=model, args=args(tmp_path, memory_budget="128KiB"), train_dataset=data)


def test_vit_trainer_plans_from_pixel_values(tmp_path):
    torch.manual_seed(0)
    model = AutoModelForImageClassification.from_config(AutoConfig.for_model(**VIT))
    data = Rows(lambda g: {"pixel_values": torch.randn(3, 32, 32, generator=g), "labels": 1})
    trainer = MemFitTrainer(model=model, args=args(tmp_path, global_batch_size=4), train_dataset=data)
    assert trainer.memfit_result.estimate.settings.task == "image-cls"
    assert any("image_size 32" in note for note in trainer.memfit_inputs["notes"])
    from hf_memfit.report.text import format_plan

    table = format_plan(trainer.memfit_result).splitlines()  # the plan says what a row is: 16 patches per image
    assert any(line.split()[:2] == ["inputs", "pixel_values"] and "16 patches" in line for line in table)
    trainer.train()
    checks = [h for h in trainer.state.log_history if "memfit/relative_error" in h]
    assert checks and abs(checks[0]["memfit/relative_error"]) < 0.10


def test_whisper_seq2seq_trainer_plans_from_input_features(tmp_path):
    torch.manual_seed(0)
    model = AutoModelForSpeechSeq2Seq.from_config(AutoConfig.for_model(**WHISPER))
    data = Rows(lambda g: {"input_features": torch.randn(16, 3000, generator=g),
                           "labels": torch.randint(3, 128, (10,), generator=g)})
    trainer = MemFitSeq2SeqTrainer(model=model, args=args(tmp_path, MemFitSeq2SeqTrainingArguments), train_dataset=data)
    settings = trainer.memfit_result.estimate.settings
    assert (settings.task, settings.label_len) == ("speech-seq2seq", 10)
    trainer.train()
    saved = json.loads((tmp_path / "out" / "memfit_plan.json").read_text())
    assert saved["plan"]["per_device_train_batch_size"] >= 1


def test_a_trainer_step_on_the_cpu_holds_the_batch_fetched_ahead(tmp_path):
    """accelerate's dataloader fetches the next batch ahead and holds it through the step; on the CPU that is the
    step's memory (`assemble.held_batches`). Rows for three steps of two, so that both measured steps have one ahead:
    the profiler's peak of the whole run (model creation on) is the logged prediction (-0.5%), which without the
    batch ahead was a batch of log-mel features (384,000 B) under (-2.8%), and the trainer's own CPU check sees the batches too."""
    from hf_memfit.estimator.measure import allocator_peak, profiled_allocations

    torch.manual_seed(0)
    data = Rows(lambda g: {"input_features": torch.randn(16, 3000, generator=g),
                           "labels": torch.randint(3, 128, (10,), generator=g)}, n=6)
    with profiled_allocations() as prof:
        model = AutoModelForSpeechSeq2Seq.from_config(AutoConfig.for_model(**WHISPER))
        trainer = MemFitSeq2SeqTrainer(model=model, args=args(tmp_path, MemFitSeq2SeqTrainingArguments),
                                       train_dataset=data)
        trainer.train()
    check = next(h for h in trainer.state.log_history if "memfit/predicted_peak_bytes" in h)
    assert trainer.memfit_plan.per_device_train_batch_size == 2
    assert check["memfit/predicted_peak_bytes"] == pytest.approx(allocator_peak(prof), rel=0.01)  # -0.5% (-2.8%)
    assert abs(check["memfit/relative_error"]) < 0.01


def test_the_cpu_check_of_an_epoch_that_ends_in_it_holds_no_batch_ahead(tmp_path):
    """A run whose epoch ends within the two checked steps fetches no batch ahead of the last: the trainer's CPU
    check compares it with the estimate less that batch (a tiny ViT on 4 rows of 64-px images, two steps of 2:
    +4.8% with the batch of pixels, -0.0% without it)."""
    fields = dict(VIT, image_size=64, hidden_size=64, intermediate_size=128)
    torch.manual_seed(0)
    data = Rows(lambda g: {"pixel_values": torch.randn(3, 64, 64, generator=g),
                           "labels": torch.randint(0, 2, (), generator=g)}, n=4)
    trainer = MemFitTrainer(model=AutoModelForImageClassification.from_config(AutoConfig.for_model(**fields)),
                            args=args(tmp_path), train_dataset=data)
    trainer.train()
    check = next(h for h in trainer.state.log_history if "memfit/relative_error" in h)
    assert trainer.memfit_plan.per_device_train_batch_size == 2 and trainer.state.epoch == 1
    assert abs(check["memfit/relative_error"]) < 0.01


def test_a_vlm_row_adds_its_image_tokens_and_traces_the_vision_tower():
    text = dict(model_type="llama", hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
                num_key_value_heads=2, vocab_size=1000)
    vision = dict(model_type="clip_vision_model", hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                  num_attention_heads=2, image_size=112, patch_size=16, projection_dim=32)
    spec = ModelSpec.from_config("tiny-llava", config(model_type="llava", image_token_index=999, image_seq_length=49,
                                                      text_config=text, vision_config=vision))
    settings = TrainSettings(batch_size=2, seq_len=32, task="image-text-to-text", device="cpu", mode="exact")
    exact = estimate_settings(spec, settings)
    assert "rows of 81 tokens" in exact.notes[0]  # 32 text + 49 image tokens
    assert exact.peak_allocated_bytes == pytest.approx(measure_cpu_peak(spec.config, exact.settings), rel=0.01)
    with pytest.raises(MemFitError, match="resizes every image to 112 px"):
        TrainSettings(batch_size=1, seq_len=8, task="image-text-to-text", image_size=336).validate(spec)


def test_a_frozen_feature_encoder_keeps_no_gradients_for_it():
    spec = ModelSpec.from_config("tiny-w2v", config(**WAV2VEC2))
    base = TrainSettings(batch_size=2, seq_len=None, task="ctc", device="cpu", audio_seconds=0.5, mode="exact")
    trained = estimate_settings(spec, base)
    frozen = estimate_settings(spec, base.replace(frozen=("wav2vec2.feature_extractor",)))
    assert frozen.trainable_params < trained.trainable_params
    assert frozen.peak_allocated_bytes == pytest.approx(measure_cpu_peak(spec.config, frozen.settings), rel=0.15)
    with pytest.raises(MemFitError, match="no such module"):
        estimate_settings(spec, base.replace(frozen=("vision_tower",)))


def test_cli_bad_media_input_is_one_line_and_exit_2(capsys, tmp_path):
    from hf_memfit.cli.main import main
    from hf_memfit.models.spec import CATALOGUE_DIR

    assert main(["estimate", "openai/whisper-large-v3", "--batch-size", "1", "--audio-seconds", "45"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "past openai/whisper-large-v3's 30 s window" in err
    assert main(["estimate", "google/vit-base-patch16-224", "--batch-size", "1", "--image-size", "384"]) == 2
    assert "takes 224x224 images only" in capsys.readouterr().err
    # a VLM whose image tokens depend on its processor, given as a folder with config.json alone
    config_only = json.loads((CATALOGUE_DIR / "Qwen--Qwen2.5-VL-7B-Instruct.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps(config_only))
    assert main(["estimate", str(tmp_path), "--batch-size", "1", "--seq-len", "64"]) == 2
    assert "processor config is missing" in capsys.readouterr().err


@pytest.mark.parametrize("argv, source", [
    (["estimate", "google/vit-base-patch16-224", "--batch-size", "1", "--seq-len", "512"],
     "its 196 patches per image, set by `--image-size`"),
    (["estimate", "facebook/wav2vec2-base-960h", "--batch-size", "1", "--audio-seconds", "10", "--seq-len", "1000"],
     "its 499 audio frames, set by `--audio-seconds`"),
    (["estimate", "openai/whisper-small", "--batch-size", "1", "--seq-len", "448"], "and `--label-len` sets the labels"),
    (["plan", "google/vit-base-patch16-224", "--gpu", "a10g", "--global-batch-size", "8", "--seq-len", "max"],
     "`--seq-len max` searches a text length"),
    (["plan", "facebook/wav2vec2-base-960h", "--gpu", "a10g", "--global-batch-size", "8", "--seq-len", "max",
      "--task", "automatic-speech-recognition"], "planned as ctc"),
])
def test_cli_seq_len_for_inputs_whose_shape_sets_the_sequence_is_one_line_and_exit_2(capsys, argv, source):
    """An image or audio encoder's sequence comes from its inputs: a `--seq-len` given there used to be dropped
    without a word (and `plan --seq-len max` answered 16,777,216 tokens for ViT)."""
    from hf_memfit.cli.main import main

    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and source in err and "drop `--seq-len`" in err
    # the length the inputs make is no conflict
    assert main(["estimate", "google/vit-base-patch16-224", "--batch-size", "1", "--seq-len", "196"]) == 0


def test_a_flag_another_task_takes_does_not_ask_an_image_model_for_a_seq_len(capsys):
    from hf_memfit.cli.main import main

    assert main(["estimate", "google/vit-base-patch16-224", "--batch-size", "1", "--images-per-sample", "2"]) == 2
    err = capsys.readouterr().err.strip()
    assert "`--images-per-sample` is for image-text-to-text models" in err and "--seq-len" not in err


def test_cache_warm_takes_image_and_audio_models_at_their_inputs_shape(tmp_path, monkeypatch, capsys):
    """`hf-memfit cache warm` (the Docker image's WARM_CACHE step) stopped at the catalogue's first image or audio
    model: it gave them 2,048 text tokens, and CTC no `--audio-seconds`. Now each is warmed at its inputs' default
    shape, and what it cannot be warmed for is named, with the reason its plan would give."""
    from hf_memfit.cache import cache_entries
    from hf_memfit.cli.main import main

    monkeypatch.setenv("HF_MEMFIT_CACHE", str(tmp_path / "cache"))
    (tmp_path / "vit").mkdir()
    (tmp_path / "vit" / "config.json").write_text(json.dumps(config(**VIT)))
    assert main(["cache", "warm", str(tmp_path / "vit"), "facebook/wav2vec2-base-960h"]) == 0
    out = capsys.readouterr().out
    assert "[1/2]" in out and "2 calibration(s) made" in out and cache_entries().get("batch-fit") == 2
    assert "not warmed for LoRA / QLoRA fine-tunes: peft has no default LoRA target modules for model type `vit`" in out
    assert "[2/2] facebook/wav2vec2-base-960h: 0 calibration(s) made" in out
    assert "not warmed for full fine-tunes: give `--audio-seconds S`" in out


def test_a_batch_fit_reads_batch_1_as_a_regime_of_its_own():
    """ViT adds its `position_embeddings` [1, patches, hidden] to every row: at batch 1 autograd hands that gradient
    to the parameter as it is (a gradient), from batch 2 on it is reduced over the rows (a temporary). The line
    through batches 1 and 2 ran the gradients category below zero, and the cut at zero put fast mode over exact
    (this tiny ViT: +0.55% at batch 8, +1.45% at 16). The first micro-batch's line now goes through batches 2 and 3."""
    spec = ModelSpec.from_config("tiny-vit", config(**VIT))
    for batch in (1, 2, 8, 16):
        settings = TrainSettings(batch_size=batch, seq_len=None, task="image-cls", device="cpu")
        fast = estimate_settings(spec, settings)
        exact = estimate_settings(spec, settings.replace(mode="exact"))
        assert fast.peak_allocated_bytes == exact.peak_allocated_bytes, batch
        assert fast.breakdown == exact.breakdown, batch
