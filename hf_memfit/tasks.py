"""The tasks hf-memfit estimates, and what each is called by transformers and peft: one table for all.

No torch or transformers import: names only, resolved where a model is built (`models/generic.py`).
"""

from typing import NamedTuple


class Task(NamedTuple):
    auto_class: str  # the transformers Auto class that builds it
    mapping: str  # that Auto class's model-type -> class-name table in transformers.models.auto.modeling_auto
    peft_task_type: str  # peft's `TaskType` for LoRA on it


TASK_TABLE = {
    "causal-lm": Task("AutoModelForCausalLM", "MODEL_FOR_CAUSAL_LM_MAPPING_NAMES", "CAUSAL_LM"),
    "seq-cls": Task("AutoModelForSequenceClassification", "MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES",
                    "SEQ_CLS"),
    "seq2seq": Task("AutoModelForSeq2SeqLM", "MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES", "SEQ_2_SEQ_LM"),
    "token-cls": Task("AutoModelForTokenClassification", "MODEL_FOR_TOKEN_CLASSIFICATION_MAPPING_NAMES",
                      "TOKEN_CLS"),
    # trained on text-only batches; LoRA on the language model is peft's causal-LM task
    "image-text-to-text": Task("AutoModelForImageTextToText", "MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES",
                               "CAUSAL_LM"),
}
TASKS = tuple(TASK_TABLE)
