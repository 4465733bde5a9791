"""What every script in `recipes/` shares: flags, model loading, data, the smoke run, and the README table.

A recipe is data (`Recipe`: model, budget, sequence length, global batch,
LoRA) plus one call to `run`. Three ways to run one:
- `--dry-run`: plan for the real model from its catalogue config, offline, and exit;
- `--smoke`: the real run's code on the CPU, with a tiny model of the same
  family saved as a local checkpoint, a small local text and a tokenizer
  trained on it, for a few steps: `load_model`, `encode_lines`, `MemFitTrainer`;
- otherwise: the real model from the Hub, wikitext-2 / SST-2 (or `--train-file`), on GPUs.

`python -m hf_memfit.integrations.recipe --update-readme` rewrites the README's recipes
table from the planner (what `--dry-run` prints, one row per recipe).
"""

import dataclasses
import importlib.util
import logging
import math
import os
import random
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from hf_memfit.errors import MemFitError, check_all
from hf_memfit.units import format_bytes

# bitsandbytes warns at import, on CPUs with AVX512-BF16, that the optional `kernels`
# package is missing; its built-in CPU kernels are used instead, so there is nothing
# to act on. Keep stderr for messages that need the user.
logging.getLogger("bitsandbytes.backends.cpu.ops").setLevel(logging.ERROR)


@dataclass(frozen=True)
class Recipe:
    """One fine-tuning job and the memory it must fit in."""

    model: str  # a Hub id the catalogue also knows, so `--dry-run` needs no network
    memory_budget: str  # per GPU
    seq_len: int
    global_batch_size: int
    task: str = "causal-lm"
    lora_r: int | None = None
    lora_alpha: int | None = None
    load_in_4bit: bool = False
    num_gpus: int = 1  # per node
    num_nodes: int = 1
    num_labels: int = 2
    # Store the packed 4-bit weights in the compute dtype, so that FSDP / ZeRO-3 can shard them
    # (bitsandbytes' default, uint8, cannot be flattened with the bf16 rest of a layer).
    shard_4bit: bool = False
    cpu_memory: str | None = None  # host RAM per node the dry-run plan must fit; None: not checked


@dataclass
class RecipeArguments:
    train_file: str | None = field(default=None, metadata={"help": "Local text file, one sample per line "
                                                                  "(`label<TAB>text` for classification). "
                                                                  "Default: wikitext-2 (SST-2 for classification)."})
    dry_run: bool = field(default=False, metadata={"help": "Print the plan for the real model (offline) and exit."})
    smoke: bool = field(default=False, metadata={"help": "The same code path on the CPU: a tiny model, local data "
                                                         "and tokenizer, a few steps (at learning rate 1e-3 unless "
                                                         "--learning_rate is given); fails unless the parameters "
                                                         "changed and, for language models, the loss on a fixed "
                                                         "batch decreased."})
    cpu_memory: str | None = field(default=None, metadata={"help": "Host RAM per node `--dry-run` plans for "
                                                                   "(e.g. 16GiB), checked against offloaded state."})
    num_nodes: int = field(default=1, metadata={"help": "Nodes to plan `--dry-run` for. A launched run plans for "
                                                        "the processes accelerate started."})


class SmokeFailure(Exception):
    """The smoke run trained, but not as it should (no steps, a non-finite loss)."""


def run(recipe: Recipe, argv: list[str] | None = None) -> int:
    """The command line: run the recipe as `argv` asks; user errors print one line and exit 2."""
    prog = os.path.basename(sys.argv[0]) if argv is None else "recipe"
    try:
        execute(recipe, argv)
    except SystemExit as exit_:  # argparse: --help (0), or a flag it does not know (2; it printed why)
        return exit_.code if isinstance(exit_.code, int) else 0 if exit_.code is None else 2
    except MemFitError as error:
        print(f"{prog}: error: {error}", file=sys.stderr)
        return 2
    except SmokeFailure as error:
        print(f"{prog}: smoke run failed: {error}", file=sys.stderr)
        return 1
    return 0


def execute(recipe: Recipe, argv: list[str] | None = None):
    """Run the recipe; return the `PlanResult` of `--dry-run`, else the trained `MemFitTrainer`."""
    train_args, recipe_args, recipe = parse_arguments(recipe, argv)
    if recipe_args.dry_run:
        from hf_memfit.report.text import format_plan

        result = plan_recipe(recipe, train_args)
        print(format_plan(result))
        return result
    _datasets()  # training needs it: say so before a model is built or a file is written
    if recipe_args.smoke:
        with tempfile.TemporaryDirectory(prefix="hf-memfit-smoke-") as scratch:
            return _smoke(recipe, train_args, recipe_args, Path(scratch))
    lines = read_lines(recipe, recipe_args.train_file)  # first: a missing dataset is cheaper to learn of than a model
    # With `--allow_pure_bf16` the weights are loaded in bf16 when the plan for this budget needs it (no
    # mixed-precision plan fits); MemFitTrainer then plans the stochastic-rounding optimizers for them.
    pure_bf16 = train_args.allow_pure_bf16 and plan_recipe(recipe, train_args).plan.settings.precision == "bf16"
    model, tokenizer = load_model(recipe, recipe.model, on_cpu=train_args.use_cpu, pure_bf16=pure_bf16)
    dataset = encode_lines(recipe, tokenizer, lines, recipe.seq_len, _source(recipe_args.train_file, "wikitext-2"))
    return _train(recipe, model, tokenizer, dataset, train_args)


def parse_arguments(recipe: Recipe, argv: list[str] | None = None):
    """`MemFitArguments` + `RecipeArguments` from `argv`, and the recipe with the flags that change it.

    The recipe's budget, global batch and output directory are the flags'
    defaults, so `--help` shows them and `--memory_budget 16GiB` overrides them.
    """
    from transformers import HfArgumentParser

    from hf_memfit.integrations.args import MemFitArguments

    parser = HfArgumentParser((MemFitArguments, RecipeArguments))
    parser.set_defaults(memory_budget=recipe.memory_budget, global_batch_size=recipe.global_batch_size,
                        num_nodes=recipe.num_nodes, output_dir=_default_output_dir(recipe))
    train_args, recipe_args, unknown = parser.parse_args_into_dataclasses(
        sys.argv[1:] if argv is None else argv, return_remaining_strings=True)
    problems = [f"unknown argument(s) {' '.join(unknown)}: see `--help`"] if unknown else []
    if recipe_args.dry_run and recipe_args.smoke:
        problems.append("`--dry-run` and `--smoke` exclude each other: give one")
    if recipe_args.num_nodes < 1:
        problems.append(f"`--num-nodes` must be a positive integer, got {recipe_args.num_nodes}")
    if recipe_args.train_file is not None and not os.path.isfile(recipe_args.train_file):
        problems.append(f"`--train-file {recipe_args.train_file}` is not a file; give a text file with one "
                        "sample per line")
    check_all(problems)
    recipe = dataclasses.replace(recipe, memory_budget=train_args.memory_budget, num_nodes=recipe_args.num_nodes,
                                 cpu_memory=recipe_args.cpu_memory or recipe.cpu_memory,
                                 global_batch_size=train_args.global_batch_size)
    return train_args, recipe_args, recipe


def _default_output_dir(recipe: Recipe) -> str:
    return os.path.join("out", recipe.model.split("/")[-1])


def plan_recipe(recipe: Recipe, args=None):
    """The plan `--dry-run` prints: the catalogue config, the recipe's knobs, the trainer's settings in `args`."""
    from hf_memfit.planner.search import plan

    knobs = {}
    if args is not None:  # MemFitArguments: the same inputs MemFitTrainer gives the planner
        knobs = dict(allow_offload=args.allow_offload, headroom=args.headroom, keep_optimizer=args.keep_optimizer,
                     optim=str(getattr(args.optim, "value", args.optim)), mode=args.memfit_mode,
                     allow_pure_bf16=args.allow_pure_bf16, allow_optimizers=args.allow_optimizers)
    return plan(recipe.model, seq_len=recipe.seq_len, global_batch_size=recipe.global_batch_size,
                gpu_memory=recipe.memory_budget, task=recipe.task, num_labels=recipe.num_labels,
                num_gpus=recipe.num_gpus, num_nodes=recipe.num_nodes, lora_r=recipe.lora_r,
                lora_alpha=recipe.lora_alpha, load_in_4bit=recipe.load_in_4bit,
                prepare_model_for_kbit_training=False,  # `_with_lora` does not call it
                bnb_4bit_quant_storage="bfloat16" if recipe.shard_4bit else None,
                precision="bf16" if _half_precision_base(recipe) else None, cpu_memory=recipe.cpu_memory, **knobs)


def _half_precision_base(recipe: Recipe) -> bool:
    # LoRA freezes the base, so it needs no fp32 master copy: it is loaded in bf16 and only
    # the adapters (fp32, peft's default) train. Full fine-tuning loads fp32 weights and the
    # plan adds bf16/fp16 autocast. QLoRA's base is 4-bit with a bf16 compute dtype.
    return bool(recipe.lora_r) and not recipe.load_in_4bit


def _train(recipe: Recipe, model, tokenizer, dataset, train_args):
    from hf_memfit.integrations.trainer import MemFitTrainer

    trainer = MemFitTrainer(model=model, args=train_args, train_dataset=dataset,
                            data_collator=_collator(recipe, tokenizer), processing_class=tokenizer)
    trainer.train()
    return trainer


def _collator(recipe: Recipe, tokenizer):
    from transformers import DataCollatorWithPadding, default_data_collator

    # Classification pads each batch to its longest line; language-model blocks all have `seq_len` tokens.
    return DataCollatorWithPadding(tokenizer) if recipe.task == "seq-cls" else default_data_collator


# --- model and data (the real run and the smoke run) -----------------------------------

def load_model(recipe: Recipe, path: str, *, on_cpu: bool = False, pure_bf16: bool = False):
    """The tokenizer and the model to train from `path` (a Hub id or a local checkpoint), with LoRA if asked."""
    import torch
    from transformers import AutoTokenizer, BitsAndBytesConfig

    from hf_memfit.models.build import auto_model_class

    on_gpu = torch.cuda.is_available() and not on_cpu
    # bf16 needs Ampere or newer; V100 / T4 get fp16. The dry run assumes bf16, like the planner.
    half = torch.float16 if on_gpu and not torch.cuda.is_bf16_supported() else torch.bfloat16
    # An explicit dtype: transformers' default ("auto") would load Llama-2-70B in fp16 and train it
    # without fp32 master weights, unlike the plan.
    kwargs = {"dtype": half if recipe.load_in_4bit or _half_precision_base(recipe) else torch.float32}
    if pure_bf16:  # full fine-tuning with no fp32 master copy, as the plan chose
        kwargs["dtype"] = torch.bfloat16
    if recipe.load_in_4bit:
        # The QLoRA recipe: NF4 with double quantisation, matmuls in half precision.
        kwargs["quantization_config"] = BitsAndBytesConfig(
            load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True, bnb_4bit_compute_dtype=half,
            bnb_4bit_quant_storage=half if recipe.shard_4bit else torch.uint8)
        if on_gpu and os.environ.get("ACCELERATE_USE_FSDP", "false").lower() not in ("1", "true", "yes"):
            # under DDP every process holds its own 4-bit copy, on its own GPU; FSDP places the shards itself
            from accelerate import PartialState

            kwargs["device_map"] = {"": PartialState().local_process_index}
    if recipe.task == "seq-cls":
        kwargs["num_labels"] = recipe.num_labels
    try:
        tokenizer = AutoTokenizer.from_pretrained(path)
        model = auto_model_class(recipe.task).from_pretrained(path, **kwargs)
    except OSError as error:  # offline, gated or misspelt: transformers' message is many lines
        raise MemFitError(f"cannot load `{path}`: {_first_line(error)}. Gated models need `hf auth login`; "
                          "`--dry-run` and `--smoke` need no download") from None
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    if model.config.pad_token_id is None:
        model.config.pad_token_id = tokenizer.pad_token_id
    return _with_lora(model, recipe), tokenizer


def _with_lora(model, recipe: Recipe):
    if not (recipe.lora_r or recipe.load_in_4bit):
        return model
    from peft import LoraConfig, get_peft_model

    # No `prepare_model_for_kbit_training`: it casts embeddings and norms to fp32 (+1 GB for
    # Llama-3.1-8B) and turns checkpointing on, and the plan decides checkpointing.
    r = recipe.lora_r or 16
    task_type = {"causal-lm": "CAUSAL_LM", "seq-cls": "SEQ_CLS", "seq2seq": "SEQ_2_SEQ_LM"}[recipe.task]
    return get_peft_model(model, LoraConfig(r=r, lora_alpha=recipe.lora_alpha or 2 * r, task_type=task_type))


def read_lines(recipe: Recipe, train_file: str | None) -> list[str]:
    """Samples from `--train-file`, else wikitext-2 (language modelling) or SST-2 (classification)."""
    if train_file:
        try:
            with open(train_file, encoding="utf-8") as handle:
                lines = [line.rstrip("\n") for line in handle if line.strip()]
        except (OSError, UnicodeDecodeError) as error:
            raise MemFitError(f"`--train-file {train_file}` cannot be read: {_first_line(error)}") from None
        if recipe.task == "seq-cls":  # checked before any model is loaded
            bad = [f"line {n} {line[:40]!r}" for n, line in enumerate(lines, 1) if _label(line, recipe) is None]
            if bad:
                raise MemFitError(f"`--train-file {train_file}`: classification needs `label<TAB>text` lines with "
                                  f"an integer label below {recipe.num_labels}; not so: {', '.join(bad[:3])}"
                                  + (f" and {len(bad) - 3} more" if bad[3:] else ""))
        return lines
    load_dataset = _datasets().load_dataset
    try:
        if recipe.task == "seq-cls":
            return [f"{row['label']}\t{row['sentence']}" for row in load_dataset("nyu-mll/glue", "sst2", split="train")]
        rows = load_dataset("Salesforce/wikitext", "wikitext-2-raw-v1", split="train")["text"]
    except (OSError, ConnectionError) as error:
        raise MemFitError(f"cannot load the default dataset: {_first_line(error)}. Give local text with "
                          "`--train-file FILE`") from None
    return [text for text in rows if text.strip()]


def _label(line: str, recipe: Recipe) -> int | None:
    label, _, text = line.partition("\t")
    label = label.strip()
    return int(label) if label.isdigit() and int(label) < recipe.num_labels and text.strip() else None


def encode_lines(recipe: Recipe, tokenizer, lines: list[str], seq_len: int, source: str = "the text"):
    """Blocks of `seq_len` tokens (language modelling) or labelled, truncated lines (classification)."""
    Dataset = _datasets().Dataset  # noqa: N806 (the class)
    if recipe.task == "seq-cls":  # lines were checked by read_lines
        encoded = tokenizer([line.partition("\t")[2] for line in lines], truncation=True, max_length=seq_len)
        return Dataset.from_dict({**encoded, "labels": [_label(line, recipe) for line in lines]})
    # As transformers' run_clm.py: tokenise each line (with the tokenizer's BOS/EOS), concatenate, cut.
    ids = [token for line_ids in tokenizer(lines)["input_ids"] for token in line_ids]
    blocks = [ids[i:i + seq_len] for i in range(0, len(ids) - seq_len + 1, seq_len)]
    if len(blocks) < 2:
        raise MemFitError(f"{source} holds {len(ids)} tokens, fewer than two blocks of {seq_len}; give more text")
    if recipe.task == "seq2seq":  # predict the next block from this one
        return Dataset.from_dict({"input_ids": blocks[:-1], "labels": blocks[1:]})
    return Dataset.from_dict({"input_ids": blocks, "labels": blocks})


def _datasets():
    """The `datasets` package, which only the recipes need (the `recipes` extra)."""
    try:
        import datasets
    except ImportError:
        raise MemFitError("recipes need the `datasets` package: pip install \"hf-memfit[recipes]\" "
                          "(or pip install datasets)") from None
    return datasets


def _source(train_file: str | None, default: str) -> str:
    return f"`--train-file {train_file}`" if train_file else default


def _first_line(error: BaseException) -> str:
    text = str(error).strip() or type(error).__name__
    return text.splitlines()[0].rstrip(".")


# --- the smoke run ---------------------------------------------------------------------

SMOKE_SEQ_LEN = 64
SMOKE_GLOBAL_BATCH = 8
SMOKE_STEPS = 3
# A few steps at the Trainer's default 5e-5 barely move a freshly initialised model, so a smoke run could not
# tell training from doing nothing; unless `--learning_rate` is given it trains at 1e-3, enough to show learning.
SMOKE_LEARNING_RATE = 1e-3

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
                                   model_max_length=SMOKE_SEQ_LEN)


# Config keys that set a model's width, by family naming; shrunk for the smoke model.
_SMOKE_SIZES = {
    ("hidden_size", "n_embd", "d_model", "word_embed_proj_dim"): 64,
    ("intermediate_size", "n_inner", "ffn_dim", "d_ff"): 128,
    ("num_attention_heads", "n_head", "num_heads"): 4,
    ("head_dim", "d_kv", "query_pre_attn_scalar"): 16,
}


def smoke_config(model: str, vocab_size: int, seq_len: int = SMOKE_SEQ_LEN) -> dict:
    """The catalogue config of `model`, with 2 layers and a small width: the same family, tiny."""
    from hf_memfit.models.spec import resolve_model

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
        if isinstance(config.get(key), (int, list)):
            config[key] = 0 if key in ("pad_token_id", "decoder_start_token_id") else 2  # <pad>, </s>
    config.pop("rope_scaling", None)  # Llama-3.1's long-context scaling assumes the full head size
    for key in ("torch_dtype", "dtype", "id2label", "label2id"):  # load_model decides these
        config.pop(key, None)
    return config


def save_smoke_checkpoint(recipe: Recipe, texts: list[str], directory: Path) -> str:
    """A tiny model of the recipe's family and a tokenizer trained on `texts`, saved as the Hub would hold them."""
    import torch
    import transformers

    from hf_memfit.models.build import auto_model_class

    torch.manual_seed(0)
    tokenizer = smoke_tokenizer(texts)
    config = transformers.AutoConfig.for_model(**smoke_config(recipe.model, len(tokenizer)))
    config.num_labels = recipe.num_labels
    model = auto_model_class(recipe.task).from_config(config)
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return str(directory)


def _smoke(recipe: Recipe, train_args, recipe_args, scratch: Path):
    texts = read_lines(recipe, recipe_args.train_file) if recipe_args.train_file else smoke_text()
    if recipe.task == "seq-cls" and not recipe_args.train_file:
        texts = [f"{int('plan' in t)}\t{t}" for t in texts]  # a learnable toy label
    path = save_smoke_checkpoint(recipe, [t.partition("\t")[2] or t for t in texts], scratch / "model")
    model, tokenizer = load_model(recipe, path, on_cpu=True)  # the real run's loader: dtype, 4-bit, LoRA
    dataset = encode_lines(recipe, tokenizer, texts, SMOKE_SEQ_LEN, _source(recipe_args.train_file, "the smoke text"))
    output_dir = train_args.output_dir
    removed = output_dir == _default_output_dir(recipe)  # not asked for: leave nothing behind
    if removed:
        output_dir = str(scratch / "output")
    train_args = dataclasses.replace(
        train_args, use_cpu=True, output_dir=output_dir, global_batch_size=SMOKE_GLOBAL_BATCH,
        memory_budget=_smoke_budget(recipe, model, max(map(len, dataset["input_ids"])), train_args.headroom),
        max_steps=train_args.max_steps if train_args.max_steps > 0 else SMOKE_STEPS,
        learning_rate=SMOKE_LEARNING_RATE if train_args.learning_rate == _default("learning_rate", train_args)
        else train_args.learning_rate,
        report_to=[], save_strategy="no", logging_steps=1, disable_tqdm=True)
    probe = _collator(recipe, tokenizer)([dataset[i] for i in range(min(SMOKE_GLOBAL_BATCH, len(dataset)))])
    before = _probe_loss(model, probe)
    weights = {name: p.detach().clone() for name, p in model.named_parameters() if p.requires_grad}
    trainer = _train(recipe, model, tokenizer, dataset, train_args)
    changed = sum(not _same_tensor(p, weights[name]) for name, p in trainer.model.named_parameters() if name in weights)
    summary = _smoke_summary(trainer, before, _probe_loss(trainer.model, probe), changed, len(weights),
                             needs_lower_loss=recipe.task != "seq-cls")
    print(summary + (" (removed)" if removed else ""))
    return trainer


def _same_tensor(a, b) -> bool:
    import torch

    return torch.equal(a.detach(), b)


def _default(name: str, args):
    return next(f.default for f in dataclasses.fields(args) if f.name == name)


def _probe_loss(model, batch) -> float:
    """The loss on a fixed batch, before and after training: it shows whether the run learned.

    In training mode with a fixed seed (the same dropout masks both times), not eval mode: on CPUs
    with AVX512-BF16, an eval-mode forward makes bitsandbytes repack 4-bit weights for inference
    (`Linear4bit.forward`, `_convert_weight_packed_for_cpu`), and training afterwards gets no gradients.
    """
    import torch

    training = model.training
    model.train()
    try:
        with torch.random.fork_rng(devices=[]), torch.no_grad():
            torch.manual_seed(0)
            return float(model(**batch).loss)
    finally:
        model.train(training)


def _smoke_budget(recipe: Recipe, model, seq_len: int, headroom: float) -> str:
    """Just room for micro-batch 2 without checkpointing: the plan must accumulate gradients, as real runs do.

    The estimate takes what MemFitTrainer will see on the CPU: the loaded dtype
    (fp32, a bf16 LoRA base, or 4-bit with bf16 compute), the adapters, and the
    longest sample (`seq_len`), for which the trainer plans.
    """
    from hf_memfit.estimator.assemble import estimate
    from hf_memfit.models.spec import ModelSpec

    base = getattr(model, "get_base_model", lambda: model)()
    spec = ModelSpec.from_config("smoke", base.config.to_dict())
    precision = "bf16-mixed" if recipe.load_in_4bit else "bf16" if _half_precision_base(recipe) else "fp32"
    peak = estimate(spec, batch_size=2, seq_len=seq_len, task=recipe.task, num_labels=recipe.num_labels,
                    precision=precision, optim="adamw_torch_fused", lora_r=recipe.lora_r, lora_alpha=recipe.lora_alpha,
                    load_in_4bit=recipe.load_in_4bit, prepare_model_for_kbit_training=False,
                    device="cpu").device_total_bytes
    return f"{math.ceil(peak * 1.02 / (1 - headroom))}B"


def _smoke_summary(trainer, probe_before: float, probe_after: float, changed: int, trainable: int,
                   needs_lower_loss: bool = True) -> str:
    plan, history = trainer.memfit_plan, trainer.state.log_history
    losses = [h["loss"] for h in history if "loss" in h]
    if trainer.state.global_step < trainer.args.max_steps or not losses:
        raise SmokeFailure(f"{trainer.state.global_step} of {trainer.args.max_steps} steps ran")
    if not all(math.isfinite(loss) for loss in losses + [probe_before, probe_after]):
        raise SmokeFailure(f"non-finite loss: {losses}, probe {probe_before} -> {probe_after}")
    if not changed:
        raise SmokeFailure(f"no trainable parameter changed in {trainer.state.global_step} steps "
                           f"({trainable} trainable tensors): the optimizer received no gradients")
    # The logged losses are of different batches; a fixed batch before and after says whether it learned.
    # Language modelling learns its token statistics within a few steps; a fresh 2-class head sits at ln 2
    # for its first steps, so there only the changed parameters are required.
    if needs_lower_loss and not probe_after < probe_before:
        raise SmokeFailure(f"the loss on a fixed batch did not decrease: {probe_before:.4f} -> {probe_after:.4f} "
                           f"(logged losses {', '.join(f'{loss:.3f}' for loss in losses)})")
    check = next((h for h in history if "memfit/measured_peak_bytes" in h), None)
    measured = (f"; measured peak {format_bytes(check['memfit/measured_peak_bytes'])}, predicted "
                f"{format_bytes(check['memfit/predicted_peak_bytes'])}" if check else "")
    return (f"smoke run passed: {trainer.state.global_step} steps of micro-batch {plan.per_device_train_batch_size} x "
            f"accumulation {plan.gradient_accumulation_steps}, gradient checkpointing "
            f"{'on' if plan.gradient_checkpointing else 'off'}, loss on a fixed batch {probe_before:.4f} -> "
            f"{probe_after:.4f}{measured}; "
            f"output in {trainer.args.output_dir}")


# --- the README's recipes table ----------------------------------------------------------

README_START = "<!-- recipes-table: generated by `python -m hf_memfit.integrations.recipe --update-readme`; do not edit -->"
README_END = "<!-- /recipes-table -->"
REPO = Path(__file__).resolve().parents[2]  # hf_memfit/integrations/recipe.py -> the repository


def load_recipe_module(path: Path):
    """Import `recipes/NAME.py` (a script, not a package module) and return the module."""
    spec = importlib.util.spec_from_file_location(f"recipes_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def recipe_rows(recipes_dir: Path = REPO / "recipes") -> list[tuple[str, Recipe, list[str]]]:
    """(script, RECIPE, extra `--dry-run` flags) for every recipe and each variant in its `README_VARIANTS`."""
    rows = []
    for path in sorted(recipes_dir.glob("*.py")):
        module = load_recipe_module(path)
        rows += [(path.name, module.RECIPE, list(flags)) for flags in ([], *getattr(module, "README_VARIANTS", ()))]
    return rows


def readme_table(recipes_dir: Path = REPO / "recipes") -> str:
    """The markdown table of every recipe's plan: what `python recipes/X.py --dry-run [flags]` prints."""
    lines = ["| Recipe | Model | GPUs x budget | Seq x global batch | Micro-batch x accumulation | Checkpointing "
             "| Optimizer | Sharding | Predicted peak per GPU | Host RAM per GPU |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for script, recipe, flags in recipe_rows(recipes_dir):
        train_args, _, recipe = parse_arguments(recipe, ["--dry-run", *flags])
        result = plan_recipe(recipe, train_args)
        p, s, est = result.plan, result.plan.settings, result.estimate
        kind = "QLoRA" if recipe.load_in_4bit else "LoRA" if recipe.lora_r else "full"
        sharding = (f"FSDP{s.fsdp_version} {s.fsdp}" if s.fsdp else f"ZeRO-{s.zero_stage}" if s.zero_stage
                    else "DDP" if s.world_size > 1 else "none")
        if s.sp_size > 1 or s.cp_size > 1:  # each sequence split over ranks
            sharding = (f"Ulysses SP {s.sp_size}" if s.sp_size > 1 else f"CP {s.cp_size}") + ", " + sharding
        offload = [f"{what} to {where}" for what, where in (("optimizer", s.offload_optimizer),
                                                           ("params", s.offload_param)) if where != "none"]
        if s.fsdp_offload:
            offload.append("params, grads & optimizer to cpu")
        gpus = f"{recipe.num_gpus * recipe.num_nodes}" + (f" ({recipe.num_nodes} nodes)" if recipe.num_nodes > 1 else "")
        command = f"`{script}" + "".join(f" {flag}" for flag in flags) + "`"
        lines.append(" | ".join([
            f"| [{command}](recipes/{script})", f"{recipe.model} ({kind})",
            f"{gpus} x {format_bytes(p.budget_bytes)}", f"{recipe.seq_len} x {recipe.global_batch_size}",
            f"{p.per_device_train_batch_size} x {p.gradient_accumulation_steps}",
            "on" if p.gradient_checkpointing else "off",
            p.optim + (" (pure bf16, stochastic rounding)" if p.optim_args and "bf16_stochastic_round" in p.optim_args
                       else ""),
            sharding + "".join(f", {o}" for o in offload), format_bytes(est.device_total_bytes),
            format_bytes(est.cpu_bytes) if est.cpu_bytes else "-"]) + " |")
    return "\n".join(lines)


def readme_with_table(readme: str, table: str) -> str:
    """`readme` with the text between the table markers replaced by `table`."""
    start, end = readme.find(README_START), readme.find(README_END)
    if start < 0 or end < start:
        raise MemFitError(f"README.md has no recipes-table markers; add {README_START} and {README_END}")
    return readme[:start + len(README_START)] + "\n" + table + "\n" + readme[end:]


def main(argv: list[str] | None = None) -> int:
    import argparse

    parser = argparse.ArgumentParser(prog="python -m hf_memfit.integrations.recipe",
                                     description="Regenerate the README's recipes table from the planner.")
    parser.add_argument("--update-readme", action="store_true", help="rewrite the table in README.md")
    parser.add_argument("--check", action="store_true", help="exit 1 if README.md's table is stale")
    args = parser.parse_args(argv)
    readme_path = REPO / "README.md"
    readme = readme_path.read_text(encoding="utf-8")
    try:
        fresh = readme_with_table(readme, readme_table())
    except MemFitError as error:
        print(f"{parser.prog}: error: {error}", file=sys.stderr)
        return 2
    if args.check:
        if fresh != readme:
            print("README.md's recipes table is stale: run `python -m hf_memfit.integrations.recipe --update-readme`",
                  file=sys.stderr)
            return 1
        return 0
    if args.update_readme:
        readme_path.write_text(fresh, encoding="utf-8")
        print(f"wrote the recipes table to {readme_path}")
    else:
        print(readme_table())
    return 0


if __name__ == "__main__":
    # Run through the package module, so recipes and this script share one `Recipe` class.
    from hf_memfit.integrations.recipe import main as _main

    raise SystemExit(_main())
