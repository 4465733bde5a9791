"""What every script in `recipes/` shares: flags, data, a tiny smoke model, and the run itself.

A recipe is data (`Recipe`: model, budget, sequence length, global batch,
LoRA) plus one call to `run`. Three ways to run one:
- `--dry-run`: plan for the real model from its catalogue config, offline, and exit;
- `--smoke`: the same code path on the CPU with a tiny model of the same
  family, a small local text and a tokenizer trained on it, for a few steps;
- otherwise: the real model from the Hub, wikitext-2 (or `--train-file`), on GPUs.
"""

import dataclasses
import random
import sys
from dataclasses import dataclass, field

from hf_memfit.errors import MemFitError


@dataclass(frozen=True)
class Recipe:
    """One fine-tuning job and the memory it must fit in."""

    model: str
    memory_budget: str  # per GPU
    seq_len: int
    global_batch_size: int
    task: str = "causal-lm"
    lora_r: int | None = None
    lora_alpha: int | None = None
    load_in_4bit: bool = False
    num_gpus: int = 1
    num_nodes: int = 1
    num_labels: int = 2


@dataclass
class RecipeArguments:
    train_file: str | None = field(default=None, metadata={"help": "Local text file (one sample per line; "
                                                                  "`label<TAB>text` for classification). Default: wikitext-2."})
    dry_run: bool = field(default=False, metadata={"help": "Print the plan for the real model (offline) and exit."})
    smoke: bool = field(default=False, metadata={"help": "Tiny model, local data and tokenizer, a few CPU steps."})
    num_nodes: int | None = field(default=None, metadata={"help": "Nodes to plan for (default: the recipe's)."})


def run(recipe: Recipe, argv: list[str] | None = None) -> int:
    """Parse `MemFitArguments` + `RecipeArguments` and run the recipe; user errors exit 2 in one line."""
    try:
        return _run(recipe, argv)
    except MemFitError as error:
        print(f"hf-memfit recipe: error: {error}", file=sys.stderr)
        return 2


def _run(recipe: Recipe, argv: list[str] | None) -> int:
    from transformers import HfArgumentParser

    from hf_memfit.args import MemFitArguments

    argv = list(sys.argv[1:] if argv is None else argv)
    if "--output_dir" not in argv:
        argv += ["--output_dir", f"out/{recipe.model.split('/')[-1]}"]
    parser = HfArgumentParser((MemFitArguments, RecipeArguments))
    try:
        train_args, recipe_args = parser.parse_args_into_dataclasses(argv)
    except SystemExit as exit_:
        return int(exit_.code or 0)
    if recipe_args.num_nodes:
        recipe = dataclasses.replace(recipe, num_nodes=recipe_args.num_nodes)
    if recipe_args.dry_run:
        return _dry_run(recipe)
    if recipe_args.smoke:
        train_args = dataclasses.replace(
            train_args, memory_budget="4GiB", use_cpu=True, max_steps=min(train_args.max_steps, 3)
            if train_args.max_steps > 0 else 3, report_to=[], save_strategy="no", global_batch_size=8,
            logging_steps=1, disable_tqdm=True)
        model, tokenizer, dataset = _smoke_setup(recipe)
    else:
        if train_args.memory_budget == "auto" and "--memory_budget" not in argv:
            train_args = dataclasses.replace(train_args, memory_budget=recipe.memory_budget)
        if train_args.global_batch_size is None:
            train_args = dataclasses.replace(train_args, global_batch_size=recipe.global_batch_size)
        model, tokenizer = _load_pretrained(recipe)
        dataset = encode_lines(recipe, tokenizer, _read_lines(recipe, recipe_args.train_file), recipe.seq_len)
    from transformers import DataCollatorWithPadding, default_data_collator

    from hf_memfit.trainer import MemFitTrainer

    collator = DataCollatorWithPadding(tokenizer) if recipe.task == "seq-cls" else default_data_collator
    trainer = MemFitTrainer(model=model, args=train_args, train_dataset=dataset, data_collator=collator,
                            processing_class=tokenizer)
    trainer.train()
    return 0


def _dry_run(recipe: Recipe) -> int:
    from hf_memfit.planner import plan
    from hf_memfit.report import format_plan

    result = plan(recipe.model, seq_len=recipe.seq_len, global_batch_size=recipe.global_batch_size,
                  gpu_memory=recipe.memory_budget, task=recipe.task, num_labels=recipe.num_labels,
                  num_gpus=recipe.num_gpus, num_nodes=recipe.num_nodes, lora_r=recipe.lora_r,
                  lora_alpha=recipe.lora_alpha, load_in_4bit=recipe.load_in_4bit)
    print(format_plan(result))
    return 0


# --- the real run --------------------------------------------------------------------

def _load_pretrained(recipe: Recipe):
    import torch
    from transformers import AutoTokenizer, BitsAndBytesConfig

    from hf_memfit.step import auto_model_class

    kwargs = {}
    if recipe.load_in_4bit:
        # The QLoRA recipe: NF4, double quantisation, bf16 compute.
        kwargs["quantization_config"] = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4",
                                                           bnb_4bit_use_double_quant=True,
                                                           bnb_4bit_compute_dtype=torch.bfloat16)
        kwargs["dtype"] = torch.bfloat16
    if recipe.task == "seq-cls":
        kwargs["num_labels"] = recipe.num_labels
    tokenizer = AutoTokenizer.from_pretrained(recipe.model)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    model = auto_model_class(recipe.task).from_pretrained(recipe.model, **kwargs)
    if model.config.pad_token_id is None:
        model.config.pad_token_id = tokenizer.pad_token_id
    return _with_lora(model, recipe), tokenizer


def _with_lora(model, recipe: Recipe):
    if not (recipe.lora_r or recipe.load_in_4bit):
        return model
    from peft import LoraConfig, get_peft_model

    task_type = {"causal-lm": "CAUSAL_LM", "seq-cls": "SEQ_CLS", "seq2seq": "SEQ_2_SEQ_LM"}[recipe.task]
    config = LoraConfig(r=recipe.lora_r or 16, lora_alpha=recipe.lora_alpha or 2 * (recipe.lora_r or 16),
                        task_type=task_type)
    return get_peft_model(model, config)


def _read_lines(recipe: Recipe, train_file: str | None) -> list[str]:
    """Samples from `--train-file`, else wikitext-2 (language modelling) or SST-2 (classification)."""
    from datasets import load_dataset

    if train_file:
        try:
            with open(train_file, encoding="utf-8") as handle:
                return [line.rstrip("\n") for line in handle if line.strip()]
        except OSError as error:
            raise MemFitError(f"`--train-file {train_file}` cannot be read: {error.strerror}") from None
    if recipe.task == "seq-cls":
        return [f"{row['label']}\t{row['sentence']}" for row in load_dataset("glue", "sst2", split="train")]
    return [t for t in load_dataset("wikitext", "wikitext-2-raw-v1", split="train")["text"] if t.strip()]


def encode_lines(recipe: Recipe, tokenizer, lines: list[str], seq_len: int):
    """Token blocks of `seq_len` (language modelling) or labelled, truncated lines (classification)."""
    from datasets import Dataset

    if recipe.task == "seq-cls":
        labels, texts = zip(*(line.split("\t", 1) if "\t" in line else ("0", line) for line in lines))
        encoded = tokenizer(list(texts), truncation=True, max_length=seq_len)
        encoded["labels"] = [int(label) % recipe.num_labels for label in labels]
        return Dataset.from_dict(dict(encoded))
    ids = tokenizer("\n".join(lines))["input_ids"]
    blocks = [ids[i:i + seq_len] for i in range(0, len(ids) - seq_len + 1, seq_len)]
    if not blocks:
        raise MemFitError(f"`--train-file` holds {len(ids)} tokens, fewer than one block of {seq_len}")
    if recipe.task == "seq2seq":  # predict the next block from this one
        return Dataset.from_dict({"input_ids": blocks[:-1], "labels": blocks[1:]})
    return Dataset.from_dict({"input_ids": blocks, "labels": blocks})


# --- the smoke run ---------------------------------------------------------------------

_WORDS = ("the model memory budget gradient layer token batch step optimizer adapter checkpoint "
          "attention sequence weight fits plan device peak train loss data small large fast").split()


def smoke_text(lines: int = 400, seed: int = 0) -> list[str]:
    """A small deterministic corpus, so smoke runs need no download."""
    rng = random.Random(seed)
    return [" ".join(rng.choice(_WORDS) for _ in range(rng.randint(8, 24))) + "." for _ in range(lines)]


def smoke_tokenizer(texts: list[str]):
    """A byte-level BPE tokenizer trained on `texts`, wrapped for transformers."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE(unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.train_from_iterator(texts, trainers.BpeTrainer(vocab_size=300, special_tokens=["<pad>", "<unk>", "</s>"]))
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, pad_token="<pad>", unk_token="<unk>", eos_token="</s>",
                                   model_max_length=64)


# Config keys that set a model's width, by family naming; shrunk for the smoke model.
_SMOKE_SIZES = {
    ("hidden_size", "n_embd", "d_model", "word_embed_proj_dim"): 64,
    ("intermediate_size", "n_inner", "ffn_dim", "d_ff"): 128,
    ("num_attention_heads", "n_head", "num_heads"): 4,
    ("head_dim", "d_kv", "query_pre_attn_scalar"): 16,
}


def smoke_config(model: str, vocab_size: int, seq_len: int = 64) -> dict:
    """The catalogue config of `model`, with 2 layers and a small width: the same family, tiny."""
    from hf_memfit.spec import resolve_model

    spec = resolve_model(model)
    config = spec.with_layers(2)
    for keys, size in _SMOKE_SIZES.items():
        for key in keys:
            if config.get(key) is not None:
                config[key] = size
    if config.get("num_key_value_heads"):
        config["num_key_value_heads"] = 2 if spec.num_key_value_heads < spec.num_attention_heads else 4
    for key in ("max_position_embeddings", "n_positions"):
        if config.get(key):
            config[key] = max(seq_len, 128)
    config["vocab_size"] = vocab_size
    for key in ("bos_token_id", "eos_token_id", "pad_token_id", "decoder_start_token_id"):
        if isinstance(config.get(key), int) or isinstance(config.get(key), list):
            config[key] = 2 if key != "pad_token_id" and key != "decoder_start_token_id" else 0
    config.pop("rope_scaling", None)  # Llama-3.1's long-context scaling assumes the full head size
    return config


def _smoke_setup(recipe: Recipe):
    import torch

    from hf_memfit.step import auto_model_class

    torch.manual_seed(0)
    texts = smoke_text()
    tokenizer = smoke_tokenizer(texts)
    config = smoke_config(recipe.model, len(tokenizer))
    import transformers

    hf_config = transformers.AutoConfig.for_model(**config)
    if recipe.task == "seq-cls":
        hf_config.num_labels = recipe.num_labels
        hf_config.pad_token_id = tokenizer.pad_token_id
    model = auto_model_class(recipe.task).from_config(hf_config)
    # A 4-bit base needs bitsandbytes' CUDA kernels; the smoke run trains LoRA on the full-precision base.
    model = _with_lora(model, recipe)
    if recipe.task == "seq-cls":
        texts = [f"{int('plan' in t)}\t{t}" for t in texts]  # a learnable toy label
    return model, tokenizer, encode_lines(recipe, tokenizer, texts, seq_len=64)
