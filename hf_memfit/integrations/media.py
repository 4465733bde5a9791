"""The shapes of an image, audio, speech or vision-language run, read off its collated batches.

The MemFit trainers collate the first rows of the training set with the run's own collator and read what
the model will get: `pixel_values` (the image size), `input_values` (seconds of audio, at the feature
extractor's sampling rate), `input_features` (Whisper's window), `labels` (CTC / decoder length),
`image_grid_thw`, LLaVA-NeXT's `image_sizes` and the image tokens among `input_ids` (a VLM's images per row
and text tokens).
"""

from __future__ import annotations

import torch

from hf_memfit.errors import CannotEstimate

_PROBE_ROWS = 16


def processor_dict(processing_class) -> dict:
    """The processor config of the run's processor (its image processor or feature extractor), or {}."""
    for candidate in (getattr(processing_class, "image_processor", None),
                      getattr(processing_class, "feature_extractor", None), processing_class):
        if candidate is not None and hasattr(candidate, "to_dict") and not hasattr(candidate, "vocab_size"):
            try:
                return {k: v for k, v in candidate.to_dict().items() if isinstance(v, (int, float, str, dict, list))}
            except Exception:  # noqa: BLE001 - a processor that cannot say its config: planned without it
                return {}
    return {}


def _batches(dataset, collator):
    if dataset is None or not hasattr(dataset, "__len__") or len(dataset) == 0:
        raise CannotEstimate("cannot tell the input shapes: give the trainer a map-style `train_dataset`")
    if collator is None:
        from transformers import default_data_collator as collator
    for index in range(min(len(dataset), _PROBE_ROWS)):
        try:
            batch = collator([dict(dataset[index])])
        except Exception as error:  # noqa: BLE001
            raise CannotEstimate(f"cannot tell the input shapes: the collator failed on row {index} "
                                 f"({type(error).__name__})") from None
        yield batch


def _dim(batch, key: str, axis: int) -> int | None:
    value = batch.get(key)
    return int(value.shape[axis]) if isinstance(value, torch.Tensor) and value.dim() > abs(axis) - (axis < 0) else None


def media_inputs(task: str, config: dict, dataset, collator) -> tuple[dict, list[str]]:
    """The `TrainSettings` input fields (seq_len, image_size, audio_seconds, label_len, images_per_sample) of the
    run's longest rows, and notes on what was read."""
    from hf_memfit.models.inputs import sampling_rate
    from hf_memfit.models.vision_language import image_layout, image_token_id

    found: dict = {"seq_len": None}
    for batch in _batches(dataset, collator):
        labels = _dim(batch, "labels", -1) if task in ("ctc", "speech-seq2seq") else None
        if labels:
            found["label_len"] = max(found.get("label_len") or 0, labels)
        if task == "image-cls" and _dim(batch, "pixel_values", -1):
            found["image_size"] = max(found.get("image_size") or 0, _dim(batch, "pixel_values", -1))
        elif task in ("audio-cls", "ctc") and _dim(batch, "input_values", -1):
            seconds = _dim(batch, "input_values", -1) / sampling_rate(config)
            found["audio_seconds"] = max(found.get("audio_seconds") or 0.0, seconds)
        elif task == "image-text-to-text" and _dim(batch, "input_ids", -1):
            ids = batch["input_ids"]
            image_tokens = int((ids[0] == image_token_id(config)).sum())
            grid = batch.get("image_grid_thw")
            if isinstance(grid, torch.Tensor) and grid.numel():
                patch = int((config.get("vision_config") or {}).get("patch_size") or 14)
                found["image_size"] = max(found.get("image_size") or 0, int(grid[:, 1:].max()) * patch)
            sizes = batch.get("image_sizes")  # LLaVA-NeXT: each image's (height, width) before tiling
            if isinstance(sizes, torch.Tensor) and sizes.numel():  # planned as a square of the longer side
                found["image_size"] = max(found.get("image_size") or 0, int(sizes.max()))
            layout = image_layout(config, found.get("image_size"))
            images = round(image_tokens / (layout["tokens"] or 1))  # 0: a text-only row
            found["images_per_sample"] = max(found.get("images_per_sample") or 0, images)
            # the text: the row less each image's placeholders and markers (Gemma-3's begin / end of image)
            text = ids.shape[-1] - images * (layout["tokens"] + layout.get("extra", 0))
            found["seq_len"] = max(found["seq_len"] or 1, text)
    found = {k: v for k, v in found.items() if v is not None}
    shown = ", ".join(f"{k} {v:g}" if isinstance(v, float) else f"{k} {v}" for k, v in found.items())
    return found, [f"input shapes read from the collated training rows: {shown}"] if shown else []


def frozen_modules(model) -> tuple[str, ...] | None:
    """The outermost modules whose parameters are all frozen, in a run without adapters (None: none frozen).

    What `freeze_feature_encoder()` or `model.vision_tower.requires_grad_(False)` left the model with; the
    plan then keeps no gradients or optimizer states for them.
    """
    if getattr(model, "peft_config", None):
        return None  # peft freezes the base itself; the adapters are the LoRA settings
    frozen: list[str] = []
    for name, module in model.named_modules():
        params = list(module.parameters())
        if not name or not params or any(p.requires_grad for p in params):
            continue
        if not any(name.startswith(outer + ".") for outer in frozen):
            frozen.append(name)
    return tuple(frozen) or None


def freeze_planned(model, names) -> list[str]:
    """Freeze the plan's frozen modules that the model still trains, as the estimate traced them; returns those.

    Each goes through the same code as the trace (`estimator.step.freeze`): the module's own `_freeze_parameters`
    where it has one (wav2vec2's feature encoder: no input gradient either), else `requires_grad_(False)`.
    """
    from hf_memfit.estimator.step import freeze

    modules = dict(model.named_modules())
    todo = [n for n in names or () if n in modules and any(p.requires_grad for p in modules[n].parameters())]
    freeze(model, todo)
    return todo
