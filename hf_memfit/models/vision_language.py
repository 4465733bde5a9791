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
- LLaVA-NeXT (`image_grid_pinpoints`, "anyres"): the image resized into the best of the pinpoint resolutions,
  cut into tiles of the tower's size, plus the whole image as a base tile; the tiles' features are unpadded back
  to the image's aspect ratio, with one newline token per row of features (`anyres_layout`).

Which rule a model follows is read from its config's keys, not its name: one rule per way of tokenizing.
"""

from __future__ import annotations

import math

from hf_memfit.models._shared import lookup, processor_config


def _rule(config: dict) -> str | None:
    vision = config.get("vision_config") if isinstance(config.get("vision_config"), dict) else {}
    if "spatial_merge_size" in vision:
        return "grid"
    if "image_grid_pinpoints" in config:
        # LLaVA-NeXT's tiles (and LLaVA-NeXT-Video's images: the same pack_image_features); LLaVA-OneVision's
        # `vision_aspect_ratio` ("anyres_max_9": modeling_llava_onevision.py's pack_image_features interpolates the
        # features of an image past 9 tiles' worth down) and Granite-4-Vision's `downsample_rate` count otherwise
        return None if any(config.get(k) for k in ("vision_aspect_ratio", "downsample_rate")) else "anyres"
    if config.get("mm_tokens_per_image"):
        return "fixed"
    if "scale_factor" in config:
        return "tiles"
    if config.get("image_token_index") is not None or config.get("image_seq_length"):
        return "clip"
    return None


def reads_batch_values(config: dict) -> bool:
    """Whether the model's code reads values of its batch: Qwen2-VL's image grid (`image_grid_thw`), Idefics3's
    pixels (it drops the all-zero padding tiles) and pixel mask, LLaVA-NeXT's `image_sizes` (its tiles per image
    and the unpadding, `.tolist()` in modeling_llava_next.py's `image_size_to_num_patches`,
    `get_anyres_image_grid_shape` and `unpad_image`). The trace keeps these real (estimator/fake_vision)."""
    return _rule(config) in ("grid", "tiles", "anyres")


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


# --- LLaVA-NeXT: any-resolution tiles (transformers 5.24, models/llava_next) -------------------------------------

def select_best_resolution(height: int, width: int, pinpoints) -> tuple[int, int]:
    """transformers' `select_best_resolution` (image_processing_utils.py): the pinpoint (height, width) that keeps
    the most of the image's pixels once it is scaled to fit, and of those the one that wastes the least."""
    best, most, least = None, 0, float("inf")
    for h, w in pinpoints:
        scale = min(w / width, h / height)
        effective = min(int(width * scale) * int(height * scale), width * height)
        wasted = w * h - effective
        if effective > most or (effective == most and wasted < least):
            best, most, least = (int(h), int(w)), effective, wasted
    return best


def _unpadded(height: int, width: int, rows: int, cols: int) -> tuple[int, int]:
    """The feature grid left after `unpad_image` (modeling_llava_next.py) crops the letterbox padding of an image of
    height x width placed in rows x cols features; `_get_unpadded_features` (processing_llava_next.py) is the same."""
    if width / height > cols / rows:
        padding = (rows - int(round(height * (cols / width), 7))) // 2
        return rows - 2 * padding, cols
    padding = (cols - int(round(width * (rows / height), 7))) // 2
    return rows, cols - 2 * padding


def default_anyres_side(config: dict) -> int:
    """`--image-size` when none is given: the longer side of the largest pinpoint (672 px for LLaVA-v1.6). Every
    square image of at least this side is scaled into that pinpoint's grid and makes the same tokens, so it is what a
    usual photo (larger than the pinpoints) becomes; for LLaVA-v1.6's pinpoints it is also the most any square image
    makes (2,928, as every square over 336 px does: checked against the processor's count from 1 to 1,400 px)."""
    tile = int((config.get("vision_config") or {}).get("image_size") or 336)
    h, w = max(anyres_pinpoints(config), key=lambda p: (p[0] * p[1], max(p)), default=(tile, tile))
    return max(h, w)


def anyres_pinpoints(config: dict) -> list[tuple[int, int]]:
    """The model's pinpoints (config.json), which decide its tiles per image; the processor's are the same list."""
    return [(int(p[0]), int(p[1])) for p in config.get("image_grid_pinpoints") or []]


def anyres_layout(config: dict, height: int, width: int) -> dict:
    """Tokens, tiles and pixels of one height x width image, as LLaVA-NeXT's processor and model make them.

    - `LlavaNextImageProcessor._get_image_patches`: the image resized into the best pinpoint (aspect kept, padded),
      cut into tiles of `crop_size`, and the whole image resized to one more tile (the base) in front: pixel_values
      (tiles + 1, 3, crop, crop) per image; `image_sizes` is the original (height, width).
    - `LlavaNextModel.get_image_features` / `pack_image_features`: each tile becomes (tile / patch)^2 features (CLIP's
      CLS dropped by the "default" `vision_feature_select_strategy`; pack_image_features' `view` needs exactly this
      many), the grid tiles are joined and unpadded to the image's aspect ratio, one `image_newline` is appended per
      row of features, and the base tile's features go first.
    - `LlavaNextProcessor._get_number_of_features` counts the same placeholders (its `num_additional_image_tokens`
      minus the dropped CLS is 0 for the published checkpoints).
    The model's tile side is `vision_config.image_size` (`image_size_to_num_patches`); the processor's crop is the
    same size (`image_problems` refuses a config where they differ).
    """
    tile = int((config.get("vision_config") or {}).get("image_size") or 336)
    per_side = tile // int((config.get("vision_config") or {}).get("patch_size") or 14)
    best = select_best_resolution(height, width, anyres_pinpoints(config))
    grid = (best[0] // tile, best[1] // tile)
    rows, cols = _unpadded(height, width, grid[0] * per_side, grid[1] * per_side)
    tiles = grid[0] * grid[1] + 1  # the grid's tiles and the base image
    return {"tokens": rows * cols + rows + per_side * per_side, "tiles": tiles, "best": best,
            "image_sizes": (height, width), "pixels": (tiles, 3, tile, tile)}


def anyres_problems(config: dict) -> list[str]:
    """What LLaVA-NeXT's own code cannot tile: the model would fail on it (or the processor disagree with it)."""
    vision, processor = config.get("vision_config") or {}, processor_config(config)
    pinpoints = config.get("image_grid_pinpoints")
    if not isinstance(pinpoints, list) or not pinpoints or \
            not all(isinstance(p, (list, tuple)) and len(p) == 2 and all(isinstance(v, int) and v > 0 for v in p)
                    for p in pinpoints):
        return [f"`image_grid_pinpoints` must be a list of [height, width] pairs of positive integers, "
                f"got {pinpoints!r}"]
    tile, patch = int(vision.get("image_size") or 336), int(vision.get("patch_size") or 14)
    if tile % patch:
        return [f"the vision tower's image_size {tile} is not a multiple of its patch_size {patch}"]
    uneven = [list(p) for p in pinpoints if p[0] % tile or p[1] % tile]
    if uneven:  # `get_anyres_image_grid_shape` floors, `image_size_to_num_patches` rounds up: the model fails
        return [f"image_grid_pinpoints {uneven} are not multiples of the vision tower's {tile}-px tile: "
                "LLaVA-NeXT's pack_image_features cannot lay out their tiles"]
    crop = int((processor.get("crop_size") or {}).get("height") or tile)
    if crop != tile:
        return [f"the processor crops {crop}-px tiles but the vision tower takes {tile} px: LLaVA-NeXT's tiles per "
                "image would not match its features"]
    theirs = processor.get("image_grid_pinpoints")
    if theirs and [list(p) for p in theirs] != [list(p) for p in pinpoints]:
        return ["the processor's image_grid_pinpoints differ from the model's: its image tokens would not match the "
                "model's features"]
    return []


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
    if rule == "anyres":  # a square image of the given side (`--image-size` is one number)
        side = image_size or default_anyres_side(config)
        return anyres_layout(config, side, side)
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
    if rule is None:
        return [f"this model's image tokens for `{spec.name}` are not modelled: only text batches can be planned for "
                "it; drop `--image-size` / `--images-per-sample`" if settings.image_size or settings.images_per_sample
                else f"this model's image tokens for `{spec.name}` are not modelled"]
    if rule == "anyres":
        return [f"`{spec.name}`: {line}" for line in anyres_problems(config)[:1]]
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
    if "best" in layout:  # LLaVA-NeXT: the grid of the best pinpoint, and the base tile
        extra += f" ({layout['tiles'] - 1} tiles of {layout['best'][0]}x{layout['best'][1]} px + the base image)"
    elif "tiles" in layout:
        extra += f" ({layout['tiles']} tiles)"
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
    elif "image_sizes" in layout:  # LLaVA-NeXT: (images, tiles + base, 3, crop, crop) and each image's (h, w)
        batch["pixel_values"] = torch.randn(b * images, *pixels, dtype=floats, device=device)
        batch["image_sizes"] = torch.tensor([layout["image_sizes"]] * (b * images), device=device)
    elif "tiles" in layout:
        from torch._subclasses.fake_tensor import unset_fake_temporarily

        # Real values in a fake trace: the model reads them (`reads_batch_values`), only to drop all-zero padding
        # tiles, so ones do (`randn` of a batch's 17 tiles took 46 ms a pass).
        with unset_fake_temporarily():
            batch["pixel_values"] = torch.ones(b, images * pixels[0], *pixels[1:], dtype=floats, device=device)
        batch["pixel_attention_mask"] = torch.ones(b, images * pixels[0], *pixels[2:], dtype=torch.bool, device=device)
    else:
        batch["pixel_values"] = torch.randn(b * images, *pixels, dtype=floats, device=device)
    if "mm_tokens_per_image" in config:  # Gemma-3's processor marks image tokens for the bidirectional mask
        batch["token_type_ids"] = (ids == token).long()
    return batch
