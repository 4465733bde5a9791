"""What the subcommands share: the parser that reports errors in one line, the flags of one training step
(`estimate`, `explain` and `check` take them; `plan` takes them without the batch), and the settings they make."""

import argparse

from hf_memfit.errors import MemFitError


class MemFitArgumentParser(argparse.ArgumentParser):
    """argparse that reports usage errors in one line with exit code 2, like every other user error."""

    def error(self, message):
        raise MemFitError(f"{message} (see `{self.prog} --help`)")


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text!r}")
    return value


def seq_len_or_max(text: str) -> int | str:
    """`--seq-len` for `plan`: a positive integer, or `max` for the longest that fits."""
    if text.strip().lower() == "max":
        return "max"
    return positive_int(text)


def positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive number, got {text!r}") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be positive, got {text!r}")
    return value


def media_inputs(args: argparse.Namespace) -> dict:
    """The image / audio flags as `TrainSettings` fields."""
    frozen = tuple(n.strip() for n in (getattr(args, "freeze", None) or "").split(",") if n.strip()) or None
    return {"frozen": frozen, **{name: getattr(args, name, None)
                                 for name in ("image_size", "images_per_sample", "audio_seconds", "label_len")}}


def add_step_arguments(parser: argparse.ArgumentParser, *, with_batch: bool = True) -> None:
    """The flags that describe a training step; shared by estimate, plan and explain."""
    from hf_memfit.settings import (ATTN_IMPLEMENTATIONS, FSDP_STRATEGIES, OFFLOAD_TARGETS, OPTIMIZERS, PRECISIONS,
                                    QUANT_STORAGE_DTYPES)
    from hf_memfit.tasks import PIPELINE_TAGS, TASKS

    parser.add_argument("model", help="catalogue name (gpt2-xl, meta-llama/Llama-3.1-8B, ...), local dir or config.json")
    if with_batch:
        parser.add_argument("--batch-size", type=positive_int, required=True, help="per-device micro-batch size")
        parser.add_argument("--gradient-accumulation-steps", type=positive_int, default=1)
    if with_batch:
        parser.add_argument("--seq-len", type=positive_int, help="tokens per sample (required unless --max-length)")
    else:
        parser.add_argument("--seq-len", type=seq_len_or_max,
                            help="tokens per sample (required unless --max-length), or `max`: the longest sequence "
                                 "that fits, with its plan (`--explain` adds how memory and step time grow to it)")
    parser.add_argument("--task", choices=TASKS + tuple(PIPELINE_TAGS), metavar="TASK",
                        help=f"one of {', '.join(TASKS)}, or the Hub's pipeline tag for one ({', '.join(PIPELINE_TAGS)});"
                             " default: the model's own (causal-lm for decoders, seq-cls for BERT, seq2seq for T5, "
                             "image-cls, ctc or speech-seq2seq for vision and speech models, image-text-to-text for "
                             "VLMs)")
    parser.add_argument("--num-labels", type=positive_int, default=2, help="classes for --task seq-cls")
    parser.add_argument("--lora-r", type=positive_int, help="train LoRA adapters of this rank (peft)")
    parser.add_argument("--lora-alpha", type=positive_int)
    parser.add_argument("--lora-target-modules", help="comma-separated module names; default: peft's for the model")
    parser.add_argument("--lora-target-regex", metavar="PATTERN",
                        help="peft's target_modules as a regex over full module names (instead of "
                             "--lora-target-modules), e.g. '.*language_model.*\\.(q_proj|v_proj)': a VLM's LM only")
    parser.add_argument("--load-in-4bit", action="store_true", help="QLoRA: 4-bit NF4 base weights (bitsandbytes)")
    parser.add_argument("--load-in-8bit", action="store_true",
                        help="LLM.int8() base weights (bitsandbytes load_in_8bit) under LoRA adapters (needs --lora-r)")
    parser.add_argument("--no-double-quant", dest="bnb_4bit_use_double_quant", action="store_false",
                        help="4-bit without double quantisation (bnb_4bit_use_double_quant=False)")
    parser.add_argument("--prepare-model-for-kbit-training", choices=("auto", "yes", "no"), default="auto",
                        help="with --load-in-4bit: whether the script calls peft's prepare_model_for_kbit_training "
                             "(embeddings, LM head and norms upcast to fp32); auto: yes for the plain Trainer on one "
                             "GPU or DDP (peft's QLoRA recipe), no for TRL's trainers, DeepSpeed and FSDP")
    parser.add_argument("--bnb-4bit-quant-storage", choices=QUANT_STORAGE_DTYPES,
                        help="dtype the packed 4-bit weights are stored in; default: uint8, or the compute dtype "
                             "when FSDP / ZeRO-3 shard them")
    parser.add_argument("--num-gpus", type=positive_int, default=1, help="GPUs per node")
    parser.add_argument("--num-nodes", type=positive_int, default=1)
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda", help="memory semantics to estimate for")
    parser.add_argument("--gpu", help="GPU model (a100, h100, rtx3060, ...): flash support and CUDA overheads")
    parser.add_argument("--expandable-segments", action="store_true",
                        help="the run sets PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True (less allocator slack)")
    parser.add_argument("--ssm-kernels", choices=("cuda", "torch"),
                        help="state-space models (Mamba, Jamba, ...): estimate mamba-ssm / causal-conv1d's CUDA "
                             "kernels (default on --device cuda) or transformers' torch fallback (default on cpu)")
    parser.add_argument("--mode", choices=("fast", "exact"), default="fast",
                        help="fast: formulas (ms); exact: trace the real model on fake tensors (seconds)")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    trl = parser.add_argument_group("TRL trainers (SFTTrainer, DPOTrainer)")
    trl.add_argument("--trainer", choices=("trainer", "sft", "dpo"), default="trainer",
                     help="the step's loss: the HF Trainer's (default) or TRL's SFT / DPO (fused LM head; DPO's "
                          "chosen + rejected rows and reference forward)")
    trl.add_argument("--max-length", type=positive_int,
                     help="TRL's max_length: the longest row (stands for --seq-len)")
    trl.add_argument("--packing", action="store_true",
                     help="SFT packing (bfd, TRL's default): rows packed to --max-length, trained padding-free")
    trl.add_argument("--padding-free", action="store_true",
                     help="the micro-batch's rows concatenated into one row (SFT padding_free)")
    trl.add_argument("--activation-offloading", action="store_true",
                     help="TRL's SFTConfig / DPOConfig activation_offloading: every saved activation of 1 KiB or "
                          "more in pinned host memory, back to the GPU in backward")
    trl.add_argument("--reference-model", choices=("copy", "adapters", "precomputed"),
                     help="DPO: a frozen copy (default for a full fine-tune), the LoRA base (default with "
                          "--lora-r), or precompute_ref_log_probs")
    parser.add_argument("--decoder-seq-len", type=positive_int, help="seq2seq: the labels' length (default --seq-len)")
    media = parser.add_argument_group("images, audio and speech (the model's config and processor config fill in "
                                      "the rest)")
    media.add_argument("--image-size", type=positive_int,
                       help="pixels per image side; default: the model's (image classification, VLM)")
    media.add_argument("--images-per-sample", type=int, help="vision-language rows: images per row (1; 0: text only)")
    media.add_argument("--audio-seconds", type=positive_float,
                       help="the longest clip (audio classification, CTC; Whisper pads to its 30 s window)")
    media.add_argument("--freeze", help="comma-separated modules trained frozen, as named_modules() names them "
                                        "(wav2vec2.feature_extractor, model.vision_tower, ...)")
    media.add_argument("--label-len", type=positive_int,
                       help="CTC characters / Whisper decoder tokens per row (default: 16 per second / 448)")
    if with_batch:
        parser.add_argument("--precision", choices=PRECISIONS, default="fp32",
                            help="*-mixed: autocast over fp32 weights; bf16/fp16: weights stored in that dtype")
        parser.add_argument("--optim", default="adamw_torch", help=f"TrainingArguments.optim: {', '.join(OPTIMIZERS)}")
        parser.add_argument("--optim-args", help='TrainingArguments.optim_args, e.g. "bf16_stochastic_round=True" '
                                                 'or "rank=64" (GaLore / APOLLO)')
        parser.add_argument("--optim-target-modules",
                            help="GaLore / APOLLO: comma-separated linear module names, or all-linear")
        parser.add_argument("--gradient-checkpointing", action="store_true")
        parser.add_argument("--offload-activations", action="store_true",
                            help="with --gradient-checkpointing: the checkpoints' inputs in pinned host memory "
                                 '(activation_checkpointing_kwargs={"offload": True})')
        parser.add_argument("--use-liger-kernel", action="store_true",
                            help="Liger's fused linear cross-entropy head (TrainingArguments.use_liger_kernel)")
        parser.add_argument("--tiled-mlp", action="store_true",
                            help="ALST's TiledMLP: each layer's MLP in sequence shards of about hidden_size tokens "
                                 "(DeepSpeed's ulysses_sp.TiledMLP; hf_memfit.apply_tiled_mlp applies it)")
        parser.add_argument("--attn-implementation", choices=ATTN_IMPLEMENTATIONS)
        parser.add_argument("--zero-stage", type=int, choices=(0, 1, 2, 3), default=0)
        parser.add_argument("--offload-optimizer", choices=OFFLOAD_TARGETS, default="none")
        parser.add_argument("--offload-param", choices=OFFLOAD_TARGETS, default="none")
        parser.add_argument("--fsdp", choices=FSDP_STRATEGIES,
                            help="PyTorch FSDP sharding strategy, as TrainingArguments --fsdp")
        parser.add_argument("--fsdp-version", type=int, choices=(1, 2), default=2,
                            help="2: fully_shard (the Trainer's default); 1: FullyShardedDataParallel")
        parser.add_argument("--fsdp-offload", action="store_true",
                            help="FSDP CPU offload: parameters, gradients and the optimizer step on the host")
        parser.add_argument("--sp-size", type=positive_int, default=1,
                            help="Ulysses sequence parallelism (DeepSpeed, with --zero-stage): each sequence split "
                                 "over this many GPUs, attention heads split among them")
        parser.add_argument("--cp-size", type=positive_int, default=1,
                            help="context parallelism (FSDP2 ring attention, with --fsdp full_shard): each sequence "
                                 "split over this many GPUs")


def step_shape(args: argparse.Namespace) -> dict:
    """seq_len and the TRL knobs from the flags: `--max-length` stands for `--seq-len`, `--packing` implies padding-free."""
    from hf_memfit.errors import check_all

    problems = []  # no --seq-len: image and audio tasks make it from their inputs, the rest say to give it
    if args.seq_len is not None and args.max_length is not None and args.seq_len != args.max_length:
        problems.append(f"`--seq-len {args.seq_len}` and `--max-length {args.max_length}` disagree; give one")
    if args.packing and args.trainer != "sft":
        problems.append("`--packing` is SFT packing: add `--trainer sft`")
    if args.packing and args.max_length is None:
        problems.append("`--packing` packs rows to `--max-length N`: give it")
    check_all(problems)
    return {"seq_len": args.seq_len or args.max_length, "trainer": args.trainer,
            "padding_free": args.padding_free or args.packing, "reference_model": args.reference_model,
            "decoder_seq_len": args.decoder_seq_len, "activation_offloading": args.activation_offloading}


def settings_from_args(args: argparse.Namespace):
    """TrainSettings from parsed estimate/explain flags."""
    from hf_memfit.settings import TrainSettings

    targets = tuple(t.strip() for t in args.lora_target_modules.split(",") if t.strip()) \
        if args.lora_target_modules else None
    optim_targets = tuple(t.strip() for t in args.optim_target_modules.split(",") if t.strip()) \
        if args.optim_target_modules else None
    return TrainSettings(
        batch_size=args.batch_size, **step_shape(args), task=args.task, num_labels=args.num_labels,
        precision=args.precision, optim=args.optim, optim_args=args.optim_args, optim_target_modules=optim_targets,
        gradient_checkpointing=args.gradient_checkpointing, use_liger_kernel=args.use_liger_kernel,
        offload_activations=args.offload_activations, tiled_mlp=args.tiled_mlp,
        attn_implementation=args.attn_implementation, gradient_accumulation_steps=args.gradient_accumulation_steps,
        lora_r=args.lora_r, lora_alpha=args.lora_alpha, lora_target_modules=targets,
        lora_target_regex=args.lora_target_regex,
        load_in_4bit=args.load_in_4bit, load_in_8bit=args.load_in_8bit, num_gpus=args.num_gpus, num_nodes=args.num_nodes,
        zero_stage=args.zero_stage, offload_optimizer=args.offload_optimizer, offload_param=args.offload_param,
        fsdp=args.fsdp, fsdp_version=args.fsdp_version, fsdp_offload=args.fsdp_offload,
        sp_size=args.sp_size, cp_size=args.cp_size,
        bnb_4bit_use_double_quant=args.bnb_4bit_use_double_quant, bnb_4bit_quant_storage=args.bnb_4bit_quant_storage,
        prepare_model_for_kbit_training=kbit_preparation(args), device=args.device, gpu=args.gpu, mode=args.mode,
        expandable_segments=args.expandable_segments, ssm_kernels=args.ssm_kernels, **media_inputs(args),
    )


def kbit_preparation(args: argparse.Namespace) -> bool | None:
    """`--prepare-model-for-kbit-training` as the settings field: None (auto), True or False."""
    return {"auto": None, "yes": True, "no": False}[args.prepare_model_for_kbit_training]


def check_writable(path: str, flag: str) -> None:
    """Make `path`'s folder if needed and check that a file can be created there; one-line error otherwise.

    Creating (and removing) a scratch file is the only test that covers every case:
    a folder, a path under a file, read-only mounts and pseudo-filesystems such as /proc.
    """
    import os
    import tempfile

    folder = os.path.dirname(os.path.abspath(path))
    hint = "give a file path in a writable folder"
    if os.path.isdir(path):
        raise MemFitError(f"`{flag} {path}` is a folder; {hint}")
    ancestor = folder
    while not os.path.exists(ancestor) and os.path.dirname(ancestor) != ancestor:
        ancestor = os.path.dirname(ancestor)
    if not os.path.isdir(ancestor):
        raise MemFitError(f"`{flag} {path}`: {ancestor} is a file, not a folder; {hint}")
    try:
        os.makedirs(folder, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=folder, prefix=".hf-memfit-", suffix=".tmp"):
            pass
    except OSError as error:
        raise MemFitError(f"`{flag} {path}`: cannot write in {folder} ({error.strerror}); {hint}") from None


def refuse_run_flags_without_vary_seq_len(args: argparse.Namespace) -> None:
    """`--micro-batches` and `--vary-image-size` shape a `--vary-seq-len` run (`estimate`, `check`): alone, one line."""
    given = [flag for flag, value in (("--micro-batches", args.micro_batches),
                                      ("--vary-image-size", args.vary_image_size)) if value is not None]
    if args.vary_seq_len is None and given:
        raise MemFitError(f"`{given[0]}` shapes a `--vary-seq-len` run: add `--vary-seq-len MIN`, or drop it")
