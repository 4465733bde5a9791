"""The step's inputs for every task, made from the model's own config and its processor config.

Text tasks take token ids (`seq_len` of them per row). The others take what their processor makes, and
their shapes come from the config, the processor config (carried in the config dict under `memfit_processor`,
see `spec.load_model_config`) and the image / audio flags:

- image classification: `pixel_values` (b, channels, size, size); `--image-size` defaults to the config's;
- audio classification and CTC: raw `input_values` (b, seconds x sampling rate), the rate from the feature
  extractor's config (16 kHz without one); CTC labels of `--label-len` characters;
- speech seq2seq (Whisper): log-mel `input_features` (b, mel bins, frames), padded to the feature extractor's
  window (30 s: 3000 frames, twice the encoder's 1500 positions), and decoder labels of `--label-len` tokens;
- multiple choice: (b, choices, seq) token ids, `--num-labels` choices; extractive QA: start and end positions;
- vision-language SFT: text tokens plus each image's tokens, as the processor expands them
  (`vision_language.py`), and the pixels the vision tower takes.

`resolve_inputs` is torch-free (the settings' validation calls it); `make_inputs` builds the tensors.
"""

from __future__ import annotations

import math

from hf_memfit.models._shared import PROCESSOR_KEY, lookup, processor_config  # noqa: F401 - re-exported
from hf_memfit.tasks import FIXED_SEQUENCE_TASKS, MEDIA_TASKS

DEFAULT_SAMPLING_RATE = 16_000  # Wav2Vec2FeatureExtractor / WhisperFeatureExtractor default
# CTC transcripts: about 15 characters per second of read speech (LibriSpeech averages 14-16); the
# labels' length barely moves the memory (CTC's alpha table is frames x (2 x labels + 1) per row).
CTC_CHARS_PER_SECOND = 16

_FLAGS = {"image_size": ("image-cls", "image-text-to-text"), "images_per_sample": ("image-text-to-text",),
          "audio_seconds": ("audio-cls", "ctc", "speech-seq2seq"), "label_len": ("ctc", "speech-seq2seq")}


def conv_frames(samples: int, config: dict) -> int:
    """Frames out of a wav2vec2-style convolutional feature encoder (`_get_feat_extract_output_lengths`)."""
    for kernel, stride in zip(config.get("conv_kernel") or (10, 3, 3, 3, 3, 2, 2),
                              config.get("conv_stride") or (5, 2, 2, 2, 2, 2, 2)):
        samples = (samples - kernel) // stride + 1
    return samples


def sampling_rate(config: dict) -> int:
    return int(processor_config(config).get("sampling_rate") or DEFAULT_SAMPLING_RATE)


def whisper_window(config: dict) -> tuple[float, int, int]:
    """(seconds, mel frames, mel bins) of a Whisper-style feature extractor's fixed window."""
    processor = processor_config(config)
    frames = 2 * int(config.get("max_source_positions") or 1500)  # the encoder's two convolutions: stride 2
    frames = int(processor.get("nb_max_frames") or frames)
    seconds = float(processor.get("chunk_length") or frames / 100)  # hop 160 at 16 kHz: 100 frames per second
    bins = int(processor.get("feature_size") or config.get("num_mel_bins") or 80)
    return seconds, frames, bins


def resolve_inputs(spec, settings):
    """(settings with the input shape filled in, problems): the torch-free half of the validation.

    For image and audio tasks `seq_len` becomes the encoder's sequence (patches, frames), which the
    speed model and the reports read; for a VLM it stays the text tokens, the image tokens come on top.
    """
    task, config, problems = settings.task, spec.config, []
    for name, tasks in _FLAGS.items():
        if getattr(settings, name) is not None and task not in tasks:
            fitting = [t for t in tasks if t in (getattr(spec, "supported_tasks", None) or ())]
            problems.append(f"`--{name.replace('_', '-')}` is for {' / '.join(tasks)} models; "
                            f"{spec.name} is planned as {task}"
                            + (f": add `--task {fitting[0]}`" if fitting else ""))
    for name in ("image_size", "images_per_sample", "label_len"):
        value = getattr(settings, name)
        minimum = 0 if name == "images_per_sample" else 1  # 0 images: text-only VLM rows
        if value is not None and (not isinstance(value, int) or value < minimum):
            problems.append(f"`--{name.replace('_', '-')}` must be a positive integer, got {value!r}")
    if settings.audio_seconds is not None and not settings.audio_seconds > 0:
        problems.append(f"`--audio-seconds` must be positive, got {settings.audio_seconds!r}")
    if problems or task not in MEDIA_TASKS:
        if settings.seq_len is None and task not in FIXED_SEQUENCE_TASKS:  # those make it from their inputs
            problems.append("give `--seq-len N` (tokens per sample)")
        return settings, problems
    if task == "image-text-to-text":
        return _vlm_inputs(spec, settings, problems)
    derived, problems = _fixed_sequence(spec, settings, problems)
    if derived is None:
        return settings, problems
    if settings.seq_len is not None and settings.seq_len != derived:
        # a text length given for inputs whose sequence their shape sets (`plan --seq-len max` is refused alike)
        problems.append(f"`--seq-len {settings.seq_len}` does not apply to {task}: {spec.name}'s sequence is "
                        f"{sequence_source(spec.config, task, derived)}; drop `--seq-len`")
    return settings.replace(seq_len=derived), problems


def sequence_source(config: dict, task: str, length: int | None = None) -> str:
    """What sets the encoder's sequence of an image / audio task, in words (`--seq-len` does not)."""
    count = f"{length:,} " if length else ""
    if task == "image-cls":
        return f"its {count}patches per image, set by `--image-size`"
    if task == "speech-seq2seq" or config.get("num_mel_bins"):
        return (f"a fixed window of {count}encoder positions (`--audio-seconds` up to "
                f"{whisper_window(config)[0]:g} s fills it)" + (", and `--label-len` sets the labels"
                                                               if task == "speech-seq2seq" else ""))
    return f"its {count}audio frames, set by `--audio-seconds`"


def _fixed_sequence(spec, settings, problems: list[str]) -> tuple[int | None, list[str]]:
    """(the encoder's sequence of an image / audio task, problems); None where the inputs refuse."""
    task, config = settings.task, spec.config
    if task == "image-cls":
        native = int(lookup(config, "image_size", 224))
        size = settings.image_size or native
        if size != native and fixed_image_size(config, task):
            return None, problems + [f"`--image-size {size}`: {spec.name} takes {native}x{native} images only "
                                     f"(the Trainer does not pass `interpolate_pos_encoding`); use "
                                     f"`--image-size {native}` or leave it out"]
        patch = int(lookup(config, "patch_size", 16))
        return max(1, (size // patch) ** 2), problems
    if task == "audio-cls" and config.get("num_mel_bins"):  # a Whisper-style encoder: its fixed window
        return int(config.get("max_source_positions") or 1500), problems
    if task in ("audio-cls", "ctc"):
        if settings.audio_seconds is None:
            return None, problems + ["give `--audio-seconds S` (the longest clip of a batch)"]
        frames = conv_frames(audio_samples(config, settings), config)
        if frames < 1:
            return None, problems + [f"`--audio-seconds {settings.audio_seconds}` is shorter than one frame "
                                     "of the feature encoder"]
        return frames, problems
    # speech-seq2seq
    seconds, _, _ = whisper_window(config)
    if settings.audio_seconds is not None and settings.audio_seconds > seconds:
        positions = config.get("max_source_positions") or 1500
        problems.append(f"`--audio-seconds {settings.audio_seconds:g}` is past {spec.name}'s {seconds:g} s window "
                        f"({positions} encoder positions); split the audio into clips of {seconds:g} s or less")
    limit = config.get("max_target_positions")
    if settings.label_len is not None and limit and settings.label_len > limit:
        problems.append(f"`--label-len {settings.label_len}` is over {spec.name}'s {limit} decoder positions; "
                        f"use `--label-len {limit}` or less")
    return int(config.get("max_source_positions") or 1500), problems


def _vlm_inputs(spec, settings, problems: list[str]):
    """A VLM's `seq_len` stays the text tokens (given), the image tokens come on top (`vision_language.py`)."""
    from hf_memfit.models.vision_language import image_problems  # image-text-to-text

    if settings.seq_len is None:
        problems.append("give `--seq-len N` (the text tokens per sample; the image tokens come on top)")
    if settings.images_per_sample == 0:
        return settings, problems  # text-only rows
    return settings, problems + image_problems(spec, settings)


def fixed_image_size(config: dict, task: str) -> bool:
    """Whether the task's model refuses images of another size than its config's.

    transformers' ViT-style embeddings check the size unless `interpolate_pos_encoding=True` is passed to
    forward, which the Trainer never does; models without that parameter (DINOv2) always interpolate.
    """
    import inspect

    from transformers.models.auto import modeling_auto

    from hf_memfit.tasks import TASK_TABLE

    import transformers

    name = getattr(modeling_auto, TASK_TABLE[task].mapping, {}).get(config.get("model_type"))
    cls = getattr(transformers, name, None) if isinstance(name, str) else None
    return cls is not None and "interpolate_pos_encoding" in inspect.signature(cls.forward).parameters


def audio_samples(config: dict, settings) -> int:
    return int(round(settings.audio_seconds * sampling_rate(config)))


def label_len(config: dict, settings) -> int:
    """The labels' length: `--label-len`, else CTC's characters for the audio, else Whisper's decoder positions."""
    if settings.label_len is not None:
        return settings.label_len
    if settings.task == "ctc":
        return max(1, math.ceil(settings.audio_seconds * CTC_CHARS_PER_SECOND))
    return int(config.get("max_target_positions") or 448)


def input_note(spec, settings) -> str | None:
    """What the estimate assumes about a non-text input, for the estimate's notes."""
    task, config = settings.task, spec.config
    if task == "image-cls":
        size = settings.image_size or lookup(config, "image_size", 224)
        return f"inputs: pixel_values {settings.batch_size}x{lookup(config, 'num_channels', 3)}x{size}x{size} " \
               f"({settings.seq_len} patches per image)"
    if task == "audio-cls" and config.get("num_mel_bins"):
        _, frames, bins = whisper_window(config)
        return f"inputs: input_features {bins}x{frames} per row (the feature extractor's fixed window)"
    if task in ("audio-cls", "ctc"):
        text = (f"inputs: {settings.audio_seconds:g} s of audio at {sampling_rate(config)} Hz "
                f"({audio_samples(config, settings)} samples, {settings.seq_len} encoder frames) per row")
        return text + (f", CTC labels of {label_len(config, settings)} characters" if task == "ctc" else "")
    if task == "speech-seq2seq":
        seconds, frames, bins = whisper_window(config)
        return (f"inputs: input_features {bins}x{frames} per row (the feature extractor pads every clip to "
                f"{seconds:g} s), decoder labels of {label_len(config, settings)} tokens")
    if task == "image-text-to-text" and settings.images_per_sample != 0:
        from hf_memfit.models.vision_language import vlm_note

        return vlm_note(spec.config, settings)
    if task == "multiple-choice":
        return f"inputs: {settings.num_labels} choices (`--num-labels`) of {settings.seq_len} tokens per row"
    return None


def batch_bytes(config: dict, settings) -> int:
    """Bytes of one collated micro-batch of the settings' shape: what `make_inputs` makes (torch-free).

    The Trainer fetches every micro-batch of an optimizer step before the first forward
    (`Trainer.get_batch_samples`, transformers 5.x, on the device when accelerate places the batches) and
    holds them until the next step's; for images and audio these are megabytes per row.
    """
    b, task = settings.batch_size, settings.task
    floats = 2 if settings.weights_dtype in ("bfloat16", "float16") else 4
    if task == "image-cls":
        size = settings.image_size or int(lookup(config, "image_size", 224))
        return b * (int(lookup(config, "num_channels", 3)) * size * size * floats + 8)
    if task == "audio-cls" and config.get("num_mel_bins"):
        _, frames, bins = whisper_window(config)
        return b * (bins * frames * floats + 8)
    if task in ("audio-cls", "ctc"):
        labels = 8 * (label_len(config, settings) if task == "ctc" else 1)
        return b * (audio_samples(config, settings) * floats + labels)
    if task == "speech-seq2seq":
        _, frames, bins = whisper_window(config)
        return b * (bins * frames * floats + 8 * label_len(config, settings))
    if task == "image-text-to-text":
        from hf_memfit.models.vision_language import image_layout, image_tokens

        if settings.images_per_sample == 0:
            return 0
        layout = image_layout(config, settings.image_size)
        pixels = math.prod(layout["pixels"]) * (settings.images_per_sample or 1)
        return b * (pixels * floats + 3 * 8 * (settings.seq_len + image_tokens(config, settings)))
    return 0


# --- the tensors ---------------------------------------------------------------------------------------

def make_inputs(config: dict, settings, device: str = "cpu") -> dict:
    """The collated batch the task's processor and collator make, at the settings' shape (random values)."""
    import torch

    b, task = settings.batch_size, settings.task
    floats = {"bfloat16": torch.bfloat16, "float16": torch.float16}.get(settings.weights_dtype, torch.float32)
    vocab = int(lookup(config, "vocab_size", 1000, towers=("text_config", "decoder")))
    if task == "image-cls":
        size = settings.image_size or int(lookup(config, "image_size", 224))
        channels = int(lookup(config, "num_channels", 3))
        return {"pixel_values": torch.randn(b, channels, size, size, dtype=floats, device=device),
                "labels": torch.randint(0, settings.num_labels, (b,), device=device)}
    if task == "audio-cls" and config.get("num_mel_bins"):  # a Whisper-style encoder classifies mel features
        _, frames, bins = whisper_window(config)
        return {"input_features": torch.randn(b, bins, frames, dtype=floats, device=device),
                "labels": torch.randint(0, settings.num_labels, (b,), device=device)}
    if task in ("audio-cls", "ctc"):
        batch = {"input_values": torch.randn(b, audio_samples(config, settings), dtype=floats, device=device)}
        if task == "ctc":  # characters 1.. (0 is the CTC blank / pad)
            batch["labels"] = torch.randint(1, max(vocab, 2), (b, label_len(config, settings)), device=device)
        else:
            batch["labels"] = torch.randint(0, settings.num_labels, (b,), device=device)
        return batch
    if task == "speech-seq2seq":
        _, frames, bins = whisper_window(config)
        return {"input_features": torch.randn(b, bins, frames, dtype=floats, device=device),
                "labels": torch.randint(0, vocab, (b, label_len(config, settings)), device=device)}
    if task == "image-text-to-text":
        from hf_memfit.models.vision_language import make_vlm_inputs

        return make_vlm_inputs(config, settings, floats, device)
    if task == "multiple-choice":
        shape = (b, settings.num_labels, settings.seq_len)
        return {"input_ids": torch.randint(0, vocab, shape, device=device),
                "attention_mask": torch.ones(shape, dtype=torch.long, device=device),
                "labels": torch.randint(0, settings.num_labels, (b,), device=device)}
    # extractive QA
    return {"input_ids": torch.randint(0, vocab, (b, settings.seq_len), device=device),
            "start_positions": torch.randint(0, settings.seq_len, (b,), device=device),
            "end_positions": torch.randint(0, settings.seq_len, (b,), device=device)}


def uses_inputs(settings) -> bool:
    """Whether `make_inputs` makes this step's batch: every task but the text ones, and VLM rows with images."""
    if settings.task == "image-text-to-text":  # DPO's VLM rows and `images_per_sample=0` rows are text only
        return settings.trainer != "dpo" and settings.images_per_sample != 0
    return settings.task in MEDIA_TASKS or settings.task in ("multiple-choice", "qa")
