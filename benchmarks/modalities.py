"""Vision, audio, speech and text-task fine-tunes through the real trainers on the CPU, predicted vs the profiler.

Each row builds a small model from a config (random weights: memory does not depend on them), a dataset of
collated-shape rows, and hf-memfit's trainer over the real one (`MemFitTrainer` = the Trainer,
`MemFitSeq2SeqTrainer` for Whisper), in a forked child under the PyTorch profiler with
`profile_memory=True`: the maximum of the running sum of the allocator's `[memory]` events from model
creation to the end of two optimizer steps is the measured peak (`hf_memfit/estimator/measure.py`'s
ground truth). The prediction is the trainer's own logged `memfit/predicted_peak_bytes` (its fast-mode
plan, from the shapes it read off the collated batch); the exact-mode estimate of the same plan, made
before the row trains, is reported beside it.

    PYTHONPATH=$PWD python benchmarks/modalities.py              # all rows -> benchmarks/results/modalities.json
    PYTHONPATH=$PWD python benchmarks/modalities.py vit-cls      # some rows, replacing theirs in the JSON
"""

from __future__ import annotations

import gc
import json
import statistics
import sys
from pathlib import Path

import torch
import transformers  # noqa: F401 - imported in the parent so that forked children start warm

sys.path.insert(0, str(Path(__file__).parent))
from common import run_forked  # noqa: E402

VIT = dict(model_type="vit", hidden_size=192, num_hidden_layers=4, num_attention_heads=3, intermediate_size=768,
           image_size=224, patch_size=16)
DINOV2 = dict(model_type="dinov2", hidden_size=192, num_hidden_layers=4, num_attention_heads=3, image_size=518,
              patch_size=14)
SIGLIP = dict(model_type="siglip", vision_config=dict(hidden_size=192, intermediate_size=768, num_hidden_layers=4,
                                                      num_attention_heads=3, image_size=224, patch_size=16),
              text_config=dict(hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=2))
WAV2VEC2 = dict(model_type="wav2vec2", hidden_size=256, num_hidden_layers=4, num_attention_heads=4,
                intermediate_size=1024, conv_dim=[128] * 7, num_conv_pos_embeddings=32,
                num_conv_pos_embedding_groups=4, vocab_size=32)
HUBERT = dict(WAV2VEC2, model_type="hubert", feat_extract_norm="layer", do_stable_layer_norm=True, conv_bias=True)
WHISPER = dict(model_type="whisper", d_model=256, encoder_layers=4, decoder_layers=4, encoder_attention_heads=4,
               decoder_attention_heads=4, encoder_ffn_dim=1024, decoder_ffn_dim=1024, vocab_size=8000, num_mel_bins=80,
               max_source_positions=1500, max_target_positions=448, pad_token_id=0, bos_token_id=1, eos_token_id=2,
               decoder_start_token_id=1)
MODERNBERT = dict(model_type="modernbert", hidden_size=256, num_hidden_layers=4, num_attention_heads=4,
                  intermediate_size=512, vocab_size=8000, global_attn_every_n_layers=2, pad_token_id=0)

TEXT = dict(model_type="llama", hidden_size=256, intermediate_size=688, num_hidden_layers=4, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=8000)
LLAVA = dict(model_type="llava", image_token_index=7999, image_seq_length=196, text_config=TEXT,
             vision_config=dict(model_type="clip_vision_model", hidden_size=192, intermediate_size=768,
                                num_hidden_layers=4, num_attention_heads=3, image_size=224, patch_size=16,
                                projection_dim=192))
GEMMA3 = dict(model_type="gemma3", mm_tokens_per_image=64, image_token_index=7999, boi_token_index=7997,
              eoi_token_index=7998,
              text_config=dict(model_type="gemma3_text", hidden_size=256, intermediate_size=688, num_hidden_layers=4,
                               num_attention_heads=4, num_key_value_heads=2, head_dim=64, vocab_size=8000,
                               sliding_window=512),
              vision_config=dict(model_type="siglip_vision_model", hidden_size=192, intermediate_size=768,
                                 num_hidden_layers=4, num_attention_heads=3, image_size=224, patch_size=14))
QWEN25VL = dict(model_type="qwen2_5_vl", hidden_size=256, intermediate_size=688, num_hidden_layers=4,
                num_attention_heads=4, num_key_value_heads=2, vocab_size=8000, image_token_id=7999,
                video_token_id=7998, vision_start_token_id=7996, vision_end_token_id=7997,
                rope_scaling={"type": "mrope", "mrope_section": [8, 12, 12]},
                vision_config=dict(depth=4, hidden_size=192, intermediate_size=768, num_heads=3, out_hidden_size=256,
                                   patch_size=14, spatial_merge_size=2, temporal_patch_size=2, window_size=112,
                                   fullatt_block_indexes=[3]))
SMOLVLM = dict(model_type="idefics3", image_token_id=7999, scale_factor=2, text_config=TEXT,
               vision_config=dict(hidden_size=192, intermediate_size=768, num_hidden_layers=4, num_attention_heads=3,
                                  image_size=128, patch_size=16))
# LLaVA-NeXT (LLaVA-v1.6's architecture): a Mistral LM, CLIP tiles of 112 px in 16-px patches (7 x 7 features each);
# a 256-px image takes the 224 x 224 pinpoint: 2 x 2 tiles + the base, 14 x 14 + 14 newlines + 49 = 259 tokens
LLAVA_NEXT = dict(model_type="llava_next", image_token_index=7999,
                  image_grid_pinpoints=[[112, 224], [224, 112], [224, 224]],
                  text_config=dict(TEXT, model_type="mistral"),
                  vision_config=dict(model_type="clip_vision_model", hidden_size=192, intermediate_size=768,
                                     num_hidden_layers=4, num_attention_heads=3, image_size=112, patch_size=16,
                                     projection_dim=192))
LLAVA_NEXT_TOKENS, LLAVA_NEXT_TILES = 14 * 14 + 14 + 7 * 7, 5

# The share of llava-vlm's roomy footprint that llava-vlm-allow-freeze gets: below every plan that trains the
# whole model, above the smallest with the vision tower frozen (found with the planner on these rows).
FREEZE_FRACTION = 0.33

# name -> (trainer, config, task Auto class, row maker, argument extras)
ROWS = {
    "vit-cls": ("trainer", VIT, "AutoModelForImageClassification", "image", {}),
    "vit-cls-bf16-mixed": ("trainer", VIT, "AutoModelForImageClassification", "image", {"bf16": True}),
    "vit-cls-lora": ("trainer", VIT, "AutoModelForImageClassification", "image", {"lora": ["q_proj", "v_proj"]}),
    "vit-cls-tight": ("trainer", VIT, "AutoModelForImageClassification", "image", {"budget_fraction": 0.5}),
    "dinov2-cls": ("trainer", DINOV2, "AutoModelForImageClassification", "image", {}),
    "siglip-cls": ("trainer", SIGLIP, "AutoModelForImageClassification", "image", {}),
    "wav2vec2-audio-cls": ("trainer", WAV2VEC2, "AutoModelForAudioClassification", "audio", {}),
    "hubert-audio-cls": ("trainer", HUBERT, "AutoModelForAudioClassification", "audio", {}),
    "whisper-seq2seq": ("seq2seq", WHISPER, "AutoModelForSpeechSeq2Seq", "speech", {}),
    "whisper-seq2seq-bf16-mixed": ("seq2seq", WHISPER, "AutoModelForSpeechSeq2Seq", "speech", {"bf16": True}),
    "whisper-seq2seq-tight": ("seq2seq", WHISPER, "AutoModelForSpeechSeq2Seq", "speech", {"budget_fraction": 0.5}),
    "whisper-audio-cls": ("trainer", WHISPER, "AutoModelForAudioClassification", "speech-cls", {}),
    "modernbert-multiple-choice": ("trainer", MODERNBERT, "AutoModelForMultipleChoice", "choices", {}),
    "modernbert-qa": ("trainer", MODERNBERT, "AutoModelForQuestionAnswering", "qa", {}),
    "wav2vec2-ctc": ("trainer", WAV2VEC2, "AutoModelForCTC", "ctc", {}),
    "wav2vec2-ctc-frozen-encoder": ("trainer", WAV2VEC2, "AutoModelForCTC", "ctc", {"freeze": "feature_encoder"}),
    "llava-vlm": ("trainer", LLAVA, "AutoModelForImageTextToText", "llava", {}),
    "llava-vlm-frozen-vision": ("trainer", LLAVA, "AutoModelForImageTextToText", "llava", {"freeze": "vision"}),
    # `allow_freeze` at a budget nothing trained whole fits in: the plan freezes the vision tower, the trainer applies it
    "llava-vlm-allow-freeze": ("trainer", LLAVA, "AutoModelForImageTextToText", "llava",
                               {"allow_freeze": True, "budget_fraction": FREEZE_FRACTION}),
    "gemma3-vlm": ("trainer", GEMMA3, "AutoModelForImageTextToText", "gemma3", {}),
    # TRL's SFTTrainer with its vision collator: PIL images and prompt / completion text, through a processor
    "llava-sft": ("sft", LLAVA, "AutoModelForImageTextToText", "llava-images", {}),
    "llava-sft-lora": ("sft", LLAVA, "AutoModelForImageTextToText", "llava-images", {"lora": ["q_proj", "v_proj"]}),
    "gemma3-sft": ("sft", GEMMA3, "AutoModelForImageTextToText", "gemma3-images", {}),
    "qwen2.5vl-sft": ("sft", QWEN25VL, "AutoModelForImageTextToText", "qwen-images", {}),
    "qwen2.5vl-sft-frozen-vision": ("sft", QWEN25VL, "AutoModelForImageTextToText", "qwen-images",
                                    {"freeze": "visual"}),
    "qwen2.5vl-sft-tight": ("sft", QWEN25VL, "AutoModelForImageTextToText", "qwen-images", {"budget_fraction": 0.45}),
    "smolvlm-sft": ("sft", SMOLVLM, "AutoModelForImageTextToText", "smol-images", {}),
    "llava-next-vlm": ("trainer", LLAVA_NEXT, "AutoModelForImageTextToText", "llava-next", {}),
    "llava-next-sft": ("sft", LLAVA_NEXT, "AutoModelForImageTextToText", "llava-next-images", {}),
    "llava-next-sft-tight": ("sft", LLAVA_NEXT, "AutoModelForImageTextToText", "llava-next-images",
                             {"budget_fraction": 0.45}),
}
BATCH = 4
# Rows per run: two optimizer steps of BATCH rows each, and a third step's, so that the measured steps are the
# steady state, with the batch accelerate's dataloader fetches ahead (the last step of an epoch has none:
# `assemble.held_batches`). With 2 x BATCH rows the second step had none, and a row whose first step peaked
# (little optimizer state: vit-cls-lora) was measured with it and predicted without it (-5.0%).
ROWS_PER_RUN = 3 * BATCH
SEQ = 256
AUDIO_SAMPLES = 16000 * 4  # 4 s at 16 kHz


def image_rows(kind: str, n: int = 8) -> list[dict]:
    """TRL's vision rows: one 256-px PIL image, a 64-word prompt after the image's placeholder, 192 words to learn."""
    import numpy as np
    from PIL import Image

    g = np.random.default_rng(0)
    placeholder = {"llava-images": "<image> ", "llava-next-images": "<image> ", "gemma3-images": "<boi> ",
                   "smol-images": "<image> ",
                   "qwen-images": "<|vision_start|> <|image_pad|> <|vision_end|> "}[kind]
    words = lambda n: " ".join(f"w{int(i)}" for i in g.integers(2, 7950, n))  # noqa: E731
    return [{"images": [Image.fromarray(g.integers(0, 255, (256, 256, 3), dtype=np.uint8))],
             "prompt": placeholder + words(64), "completion": words(192)} for _ in range(n)]


def processor(kind: str):
    """The model's processor, built offline: its image processor class and a word-level tokenizer with its tokens."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    specials = {"llava-images": {"<image>": 7999}, "llava-next-images": {"<image>": 7999},
                "gemma3-images": {"<boi>": 7997, "<eoi>": 7998, "<img>": 7999},
                "qwen-images": {"<|vision_start|>": 7996, "<|vision_end|>": 7997, "<|video_pad|>": 7998,
                                "<|image_pad|>": 7999},
                "smol-images": {"<image>": 7999, "<fake_token_around_image>": 7998, "<end_of_utterance>": 7997,
                                "<global-img>": 7996, **{f"<row_{i}_col_{j}>": 7943 + 6 * i + j
                                                         for i in range(1, 7) for j in range(1, 7)}}}[kind]
    vocab = {"<pad>": 0, "<unk>": 1, **{f"w{i}": i for i in range(2, 7950)}, **specials}
    words = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    words.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    named = {"llava-images": {"image_token": "<image>"}, "llava-next-images": {"image_token": "<image>"},
             "gemma3-images": {"boi_token": "<boi>", "image_token": "<img>", "eoi_token": "<eoi>"},
             "qwen-images": {"image_token": "<|image_pad|>", "video_token": "<|video_pad|>"}, "smol-images": {}}[kind]
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=words, pad_token="<pad>", unk_token="<unk>",
                                        extra_special_tokens=named)
    if kind == "llava-images":  # CLIP at 224 px, 16-px patches: 196 tokens once the CLS feature is dropped
        from transformers import CLIPImageProcessor, LlavaProcessor

        return LlavaProcessor(CLIPImageProcessor(size={"shortest_edge": 224}, crop_size={"height": 224, "width": 224}),
                              tokenizer, patch_size=16, vision_feature_select_strategy="default",
                              num_additional_image_tokens=1, image_token="<image>")
    if kind == "llava-next-images":  # its PIL image processor (the torchvision one needs torchvision): 112-px tiles
        from transformers import LlavaNextProcessor
        from transformers.models.llava_next.image_processing_pil_llava_next import LlavaNextImageProcessorPil

        images = LlavaNextImageProcessorPil(size={"shortest_edge": 112}, crop_size={"height": 112, "width": 112},
                                            image_grid_pinpoints=LLAVA_NEXT["image_grid_pinpoints"])
        return LlavaNextProcessor(images, tokenizer, patch_size=16, vision_feature_select_strategy="default",
                                  num_additional_image_tokens=1, image_token="<image>")
    if kind == "qwen-images":  # 256 px -> 252 x 252 (smart_resize): 18 x 18 patches of 14 px, 81 tokens
        from transformers import Qwen2VLImageProcessor

        return _image_only_qwen_processor()(Qwen2VLImageProcessor(patch_size=14, merge_size=2, temporal_patch_size=2),
                                            tokenizer)
    if kind == "smol-images":  # 256 px in 128-px tiles: 2 x 2 tiles + the global view, 16 tokens each
        from transformers import Idefics3ImageProcessor, Idefics3Processor

        return Idefics3Processor(Idefics3ImageProcessor(size={"longest_edge": 256}, max_image_size={"longest_edge": 128},
                                                        do_image_splitting=True), tokenizer, image_seq_len=16)
    from transformers import Gemma3ImageProcessor, Gemma3Processor

    return Gemma3Processor(Gemma3ImageProcessor(size={"height": 224, "width": 224}), tokenizer,
                           image_seq_length=GEMMA3["mm_tokens_per_image"])


def _image_only_qwen_processor():
    """Qwen2.5-VL's processor without its video processor, which needs torchvision (not installed here)."""
    from transformers import ProcessorMixin, Qwen2_5_VLProcessor

    class ImageOnlyQwen2_5_VLProcessor(Qwen2_5_VLProcessor):
        def __init__(self, image_processor=None, tokenizer=None, chat_template=None, **kwargs):
            self.image_token, self.video_token = tokenizer.image_token, tokenizer.video_token
            self.image_token_id = tokenizer.convert_tokens_to_ids(self.image_token)
            self.video_token_id = tokenizer.convert_tokens_to_ids(self.video_token)
            ProcessorMixin.__init__(self, image_processor, tokenizer, chat_template=chat_template)
            self.video_processor = None

    return ImageOnlyQwen2_5_VLProcessor


def rows(kind: str, n: int = 8) -> list[dict]:
    if kind.endswith("-images"):
        return image_rows(kind, n)
    g = torch.Generator().manual_seed(0)
    out = []
    for _ in range(n):
        if kind == "image":
            out.append({"pixel_values": torch.randn(3, 224, 224, generator=g), "labels": 1})
        elif kind == "audio":
            out.append({"input_values": torch.randn(AUDIO_SAMPLES, generator=g), "labels": 1})
        elif kind in ("speech", "speech-cls"):
            row = {"input_features": torch.randn(80, 3000, generator=g)}
            row["labels"] = torch.randint(3, 8000, (64,), generator=g) if kind == "speech" else 1
            out.append(row)
        elif kind == "ctc":
            out.append({"input_values": torch.randn(AUDIO_SAMPLES, generator=g),
                        "labels": torch.randint(1, 32, (60,), generator=g)})
        elif kind in ("llava", "gemma3"):  # one image's placeholders (and Gemma-3's markers), then the text
            image = [7999] * 196 if kind == "llava" else [7997] + [7999] * 64 + [7998]
            ids = torch.tensor(image + torch.randint(1, 7990, (SEQ,), generator=g).tolist())
            labels = ids.clone()
            labels[: len(image)] = -100
            row = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": labels,
                   "pixel_values": torch.randn(3, 224, 224, generator=g)}
            if kind == "gemma3":
                row["token_type_ids"] = (ids == 7999).long()
            out.append(row)
        elif kind == "llava-next":  # what LlavaNextProcessor makes of a 256-px image: 5 tiles, its (h, w)
            ids = torch.tensor([7999] * LLAVA_NEXT_TOKENS + torch.randint(1, 7990, (SEQ,), generator=g).tolist())
            labels = ids.clone()
            labels[:LLAVA_NEXT_TOKENS] = -100
            out.append({"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": labels,
                        "pixel_values": torch.randn(LLAVA_NEXT_TILES, 3, 112, 112, generator=g),
                        "image_sizes": torch.tensor([256, 256])})
        elif kind == "choices":
            out.append({"input_ids": torch.randint(1, 8000, (2, SEQ), generator=g),
                        "attention_mask": torch.ones(2, SEQ, dtype=torch.long), "labels": 1})
        else:
            out.append({"input_ids": torch.randint(1, 8000, (SEQ,), generator=g), "start_positions": 3,
                        "end_positions": 9})
    return out


class Rows(torch.utils.data.Dataset):
    def __init__(self, items):
        self.items = items

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        return self.items[i]


def make_trainer(name: str, budget: str, out: str, data: list[dict]):
    import transformers
    from transformers import AutoConfig

    from hf_memfit.integrations.args import MemFitArguments
    from hf_memfit.integrations.trainer import MemFitSeq2SeqTrainer, MemFitSeq2SeqTrainingArguments, MemFitTrainer

    kind, fields, auto, _, extras = ROWS[name]
    torch.manual_seed(0)
    model = getattr(transformers, auto).from_config(AutoConfig.for_model(**fields))
    if extras.get("freeze") == "feature_encoder":
        model.freeze_feature_encoder()
    elif extras.get("freeze") == "vision":
        model.model.vision_tower.requires_grad_(False)
    elif extras.get("freeze") == "visual":  # Qwen2.5-VL's vision tower
        model.model.visual.requires_grad_(False)
    if kind == "sft":  # TRL wraps the model in peft itself, from `peft_config`
        from datasets import Dataset

        from hf_memfit.integrations.trl import MemFitSFTConfig, MemFitSFTTrainer

        lora = None
        if extras.get("lora"):
            from peft import LoraConfig

            lora = LoraConfig(r=8, target_modules=extras["lora"], task_type="CAUSAL_LM")
        args = MemFitSFTConfig(output_dir=out, memory_budget=budget, per_device_train_batch_size=BATCH, max_steps=2,
                               report_to=[], save_strategy="no", use_cpu=True, logging_steps=1, disable_tqdm=True,
                               bf16=extras.get("bf16", False), learning_rate=1e-4,
                               max_length=None)
        return MemFitSFTTrainer(model=model, args=args, train_dataset=Dataset.from_list(data),
                                processing_class=processor(ROWS[name][3]), peft_config=lora)
    if extras.get("lora"):
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(model, LoraConfig(r=8, target_modules=extras["lora"], modules_to_save=["classifier"]))
    args_cls, trainer_cls = (MemFitSeq2SeqTrainingArguments, MemFitSeq2SeqTrainer) if kind == "seq2seq" else \
        (MemFitArguments, MemFitTrainer)
    args = args_cls(output_dir=out, memory_budget=budget, per_device_train_batch_size=BATCH, max_steps=2,
                    report_to=[], save_strategy="no", use_cpu=True, logging_steps=1, disable_tqdm=True,
                    bf16=extras.get("bf16", False), learning_rate=1e-4, allow_freeze=extras.get("allow_freeze", False))
    return trainer_cls(model=model, args=args, train_dataset=Rows(data))


def processor_outputs_in_torch_memory() -> None:
    """Copy what an image processor returns as numpy arrays into torch's allocator, where the profiler sees it.

    Without torchvision, transformers falls back to its PIL image processors, and `BatchFeature` wraps their numpy
    pixels with `torch.from_numpy`: memory the CPU allocator's events never show, so the TRL rows measured none of
    their batches' pixels. On a GPU the batch is copied to the device (`send_to_device`), into the caching allocator;
    with torchvision the default processors make torch tensors. The copy is made where the processor returns, in the
    collator, before the step; the numpy array it came from is freed with the processor's output.
    """
    import numpy as np
    from transformers.feature_extraction_utils import BatchFeature

    original = BatchFeature._get_is_as_tensor_fns

    def tensor_fns(self, tensor_type=None):
        is_tensor, as_tensor = original(self, tensor_type)
        if as_tensor is None:
            return is_tensor, as_tensor

        def in_torch_memory(value, *args, **kwargs):
            out = as_tensor(value, *args, **kwargs)
            first = value[0] if isinstance(value, (list, tuple)) and len(value) else value
            from_numpy = isinstance(first, np.ndarray) or (isinstance(first, (list, tuple)) and len(first)
                                                            and isinstance(first[0], np.ndarray))
            return out.clone() if from_numpy and torch.is_tensor(out) else out

        return is_tensor, in_torch_memory

    BatchFeature._get_is_as_tensor_fns = tensor_fns


def run_row(name: str, emit) -> None:
    from hf_memfit.estimator.measure import allocator_peak, profiled_allocations

    from hf_memfit.estimator.assemble import estimate_settings
    from hf_memfit.models.spec import ModelSpec

    extras = ROWS[name][4]
    processor_outputs_in_torch_memory()  # in this row's forked child only
    out = f"/tmp/hf_memfit_modal_bench/{name}"
    # The dataset is made before the profiler starts: its rows (images or clips) are the data, not the step.
    data = rows(ROWS[name][3], ROWS_PER_RUN)
    budget = "8GiB"
    if "budget_fraction" in extras:  # a budget that forces the plan off the roomy one
        roomy = make_trainer(name, budget, out, data)
        budget = str(int(roomy.memfit_result.estimate.device_total_bytes * extras["budget_fraction"]))
        del roomy
        gc.collect()
    planned = make_trainer(name, budget, out, data)
    settings = planned.memfit_result.estimate.settings
    spec = planned.memfit_inputs["model"]  # the model's config, with its processor config where the run has one
    exact = estimate_settings(ModelSpec.from_config(name, spec.config), settings.replace(mode="exact"))
    del planned, spec
    gc.collect()
    with profiled_allocations() as prof:
        trainer = make_trainer(name, budget, out, data)
        trainer.train()
    measured = allocator_peak(prof)
    check = next(h for h in trainer.state.log_history if "memfit/predicted_peak_bytes" in h)
    plan = trainer.memfit_plan
    emit({"row": name, "trainer": type(trainer).__name__, "task": settings.task, "budget": budget,
          "measured_profiler_bytes": measured, "predicted_fast_bytes": check["memfit/predicted_peak_bytes"],
          "predicted_exact_bytes": exact.peak_allocated_bytes + exact.cpu_bytes,
          "plan": {"micro_batch": plan.per_device_train_batch_size, "accumulation": plan.gradient_accumulation_steps,
                   "checkpointing": plan.gradient_checkpointing, "optim": plan.optim, "seq_len": settings.seq_len,
                   "precision": settings.precision, "lora_r": settings.lora_r, "trainer": settings.trainer, "image_size": settings.image_size,
                   "audio_seconds": settings.audio_seconds, "label_len": settings.label_len,
                   "frozen": settings.frozen}})


def main(names: list[str]) -> int:
    unknown = [name for name in names if name not in ROWS]
    if unknown:
        print(f"modalities.py: unknown row(s) {', '.join(unknown)}; the rows are: {', '.join(ROWS)}", file=sys.stderr)
        return 2
    results = []
    for name in names or list(ROWS):
        result, crash = run_forked(lambda emit, name=name: run_row(name, emit), timeout_s=1200)
        if crash or "row_error" in result:
            print(f"{name}: FAILED {crash or result['row_error']}\n{result.get('traceback', '')}", flush=True)
            results.append({"row": name, "error": crash or result["row_error"]})
            continue
        for mode in ("fast", "exact"):
            result[f"error_{mode}"] = result[f"predicted_{mode}_bytes"] / result["measured_profiler_bytes"] - 1
        results.append(result)
        p = result["plan"]
        print(f"{name:28} measured {result['measured_profiler_bytes'] / 2**20:8.2f} MiB  fast {result['error_fast']:+6.1%}"
              f"  exact {result['error_exact']:+6.1%}   plan micro {p['micro_batch']} x acc {p['accumulation']}, "
              f"ckpt {p['checkpointing']}, {p['optim']}, {p['precision']}", flush=True)
    done = [r for r in results if "error" not in r]
    failed = len(results) - len(done)  # this run's rows (before the saved ones are merged in below)
    for mode in ("fast", "exact"):
        errors = [abs(r[f"error_{mode}"]) for r in done]
        if errors:
            print(f"{mode}: median |error| {statistics.median(errors):.1%}, max {max(errors):.1%} over {len(errors)} rows")
    path = Path(__file__).parent / "results" / "modalities.json"
    if names and path.exists():
        fresh = {r["row"]: r for r in results}
        results = [fresh.pop(r["row"], r) for r in json.loads(path.read_text())] + list(fresh.values())
    path.write_text(json.dumps(results, indent=2) + "\n")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
