"""Vision-language models: how many tokens an image becomes, and the pixels the vision tower takes.

Each rule is the processor's own (transformers 5.24 image processors), read from the processor config
(`preprocessor_config.json`, carried as `memfit_processor`) with the config as the fallback:

- Qwen2-VL / Qwen2.5-VL (`image_grid_thw` in the batch): the image is resized to a multiple of
  patch x merge (14 x 2 = 28 px) with min_pixels <= h x w <= max_pixels (`smart_resize`); the vision tower
  takes (h/14) x (w/14) patches of 3 x 2 x 14 x 14 values, and merges 2 x 2 of them into one LM token.
- Gemma-3 (`mm_tokens_per_image`): one 896-px crop, 256 tokens (plus begin / end of image).
- LLaVA-1.5 (`image_seq_length`, a fixed-size CLIP tower): (image_size / patch)^2 tokens, 576 at 336 px.
- Idefics3 / SmolVLM (`scale_factor`, `image_seq_len`): the image cut into tiles of the vision tower's size
  plus one global view; each tile is (size / patch)^2 / scale_factor^2 tokens.

Which rule a model follows is read from its config's keys, not its name: one rule per way of tokenizing.
"""

from __future__ import annotations

import math

from hf_memfit.models._shared import lookup, processor_config


def _rule(config: dict) -> str | None:
    vision = config.get("vision_config") if isinstance(config.get("vision_config"), dict) else {}
    if "spatial_merge_size" in vision or "image_grid_pinpoints" in config:
        return "grid" if "spatial_merge_size" in vision else "anyres"
    if config.get("mm_tokens_per_image"):
        return "fixed"
    if "scale_factor" in config:
        return "tiles"
    if config.get("image_token_index") is not None or config.get("image_seq_length"):
        return "clip"
    return None


def reads_batch_values(config: dict) -> bool:
    """Whether the model's code reads values of its batch: Qwen2-VL's image grid (`image_grid_thw`), Idefics3's
    pixels (it drops the all-zero padding tiles) and pixel mask. The trace keeps these real (estimator/fake_vision)."""
    return _rule(config) in ("grid", "tiles")


def _images(settings) -> int:
    """Images per row: 1 unless given (0: text-only rows)."""
    return 1 if settings.images_per_sample is None else settings.images_per_sample


def image_token_id(config: dict) -> int:
    for key in ("image_token_id", "image_token_index"):
        if config.get(key) is not None:
            return int(config[key])
    text = config.get("text_config") or {}
    return int(text.get("vocab_size", 1000)) - 1


def smart_resize(height: int, width: int, factor: int, min_pixels: int, max_pixels: int) -> tuple[int, int]:
    """Qwen2-VL's `smart_resize` (image_processing_qwen2_vl.py): both sides multiples of `factor`, area in range."""
    h, w = max(factor, round(height / factor) * factor), max(factor, round(width / factor) * factor)
    if h * w > max_pixels:
        beta = math.sqrt(height * width / max_pixels)
        h, w = max(factor, math.floor(height / beta / factor) * factor), max(factor, math.floor(width / beta / factor) * factor)
    elif h * w < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h, w = math.ceil(height * beta / factor) * factor, math.ceil(width * beta / factor) * factor
    return h, w


def image_layout(config: dict, image_size: int | None) -> dict:
    """{"tokens": LM tokens per image, "pixels": the pixel tensor's shape per image, ...} by the model's rule."""
    rule, processor, vision = _rule(config), processor_config(config), config.get("vision_config") or {}
    patch = int(vision.get("patch_size") or 14)
    if rule == "grid":
        merge = int(vision.get("spatial_merge_size") or 2)
        temporal = int(vision.get("temporal_patch_size") or processor.get("temporal_patch_size") or 2)
        size = processor.get("size") or {}
        min_pixels = int(processor.get("min_pixels") or size.get("shortest_edge") or 56 * 56)
        max_pixels = int(processor.get("max_pixels") or size.get("longest_edge") or 28 * 28 * 1280)
        side = image_size or 448
        h, w = smart_resize(side, side, patch * merge, min_pixels, max_pixels)
        grid = (1, h // patch, w // patch)
        return {"tokens": grid[1] * grid[2] // merge ** 2, "grid": grid, "resized": (h, w),
                "pixels": (grid[1] * grid[2], 3 * temporal * patch * patch)}
    native = int(vision.get("image_size") or 224)
    if rule == "fixed":
        # the image's placeholder tokens, plus its begin- and end-of-image tokens (Gemma3Processor)
        return {"tokens": int(config["mm_tokens_per_image"]), "extra": 2, "pixels": (3, native, native),
                "fixed": native}
    if rule == "clip":
        tokens = int(processor.get("image_seq_length") or config.get("image_seq_length") or (native // patch) ** 2)
        return {"tokens": tokens, "pixels": (3, native, native), "fixed": native}
    if rule == "tiles":
        tile = int((processor.get("max_image_size") or {}).get("longest_edge") or native)
        longest = int((processor.get("size") or {}).get("longest_edge") or 4 * tile)
        side = min(image_size or longest, longest)
        per_side = math.ceil(side / tile)
        tiles = per_side * per_side + (1 if per_side > 1 else 0)  # the tiles, plus the global view
        per_tile = int(config.get("image_seq_len") or processor.get("image_seq_len")
                       or (native // patch) ** 2 // int(config["scale_factor"]) ** 2)
        return {"tokens": tiles * per_tile, "tiles": tiles, "pixels": (tiles, 3, native, native)}
    return {}


def image_problems(spec, settings) -> list[str]:
    """One line for what cannot be planned: an unknown image rule, no processor config, a fixed size changed."""
    config, rule = spec.config, _rule(spec.config)
    if rule in (None, "anyres"):
        what = "LLaVA-NeXT any-resolution tiling" if rule == "anyres" else "this model's image tokens"
        return [f"{what} for `{spec.name}` is not modelled: only text batches can be planned for it; "
                "drop `--image-size` / `--images-per-sample`" if settings.image_size or settings.images_per_sample
                else f"{what} for `{spec.name}` is not modelled"]
    if rule in ("grid", "tiles") and not processor_config(config) and settings.image_size is None:
        return [f"`{spec.name}` makes a varying number of tokens per image and its processor config is missing: "
                "pass a model directory with preprocessor_config.json, or give `--image-size`"]
    layout = image_layout(config, settings.image_size)
    fixed = layout.get("fixed")
    if fixed and settings.image_size is not None and settings.image_size != fixed:
        return [f"`--image-size {settings.image_size}`: {spec.name}'s processor resizes every image to {fixed} px; "
                f"use `--image-size {fixed}` or leave it out"]
    return []


def image_tokens(config: dict, settings) -> int:
    """All the tokens the images of one sample add to its row (placeholders and their markers)."""
    layout = image_layout(config, settings.image_size)
    return _images(settings) * (layout["tokens"] + layout.get("extra", 0))


def vlm_note(config: dict, settings) -> str:
    layout = image_layout(config, settings.image_size)
    images = _images(settings)
    extra = f" (resized to {layout['resized'][0]}x{layout['resized'][1]} px)" if "resized" in layout else ""
    extra += f" ({layout['tiles']} tiles)" if "tiles" in layout else ""
    per_image = layout["tokens"] + layout.get("extra", 0)
    return (f"inputs: {images} image(s) per sample of {per_image} tokens each{extra}, on top of "
            f"{settings.seq_len} text tokens: rows of {settings.seq_len + images * per_image} tokens")


def make_vlm_inputs(config: dict, settings, floats, device: str) -> dict:
    """Token ids with the image placeholders where the processor puts them, labels, and the pixels."""
    import torch

    b, images = settings.batch_size, _images(settings)
    layout = image_layout(config, settings.image_size)
    per_image = layout["tokens"]
    total = settings.seq_len + image_tokens(config, settings)
    vocab = int(lookup(config, "vocab_size", 1000, towers=("text_config",)))
    token = image_token_id(config)
    ids = torch.randint(0, min(vocab, token) if token > 0 else vocab, (b, total), device=device)
    ids[:, : images * per_image] = token  # the images first, then the text
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids.clone()}
    batch["labels"][:, : images * per_image] = -100  # the collator masks the image tokens out of the loss
    pixels = layout["pixels"]
    if "grid" in layout:
        batch["pixel_values"] = torch.randn(b * images * pixels[0], pixels[1], dtype=floats, device=device)
        batch["image_grid_thw"] = torch.tensor([layout["grid"]] * (b * images), device=device)
        batch["mm_token_type_ids"] = (ids == token).int()  # the processor's: 1 for image tokens (3-D positions)
    elif "tiles" in layout:
        from torch._subclasses.fake_tensor import unset_fake_temporarily

        with unset_fake_temporarily():  # real values in a fake trace (the model reads them; see reads_batch_values)
            batch["pixel_values"] = torch.randn(b, images * pixels[0], *pixels[1:], dtype=floats, device=device)
        batch["pixel_attention_mask"] = torch.ones(b, images * pixels[0], *pixels[2:], dtype=torch.bool, device=device)
    else:
        batch["pixel_values"] = torch.randn(b * images, *pixels, dtype=floats, device=device)
    if "mm_tokens_per_image" in config:  # Gemma-3's processor marks image tokens for the bidirectional mask
        batch["token_type_ids"] = (ids == token).long()
    return batch
