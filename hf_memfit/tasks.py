"""The tasks hf-memfit estimates, and what each is called by transformers and peft: one table for all.

No torch or transformers import: names only, resolved where a model is built (`models/generic.py`).
"""

from typing import NamedTuple


class Task(NamedTuple):
    auto_class: str  # the transformers Auto class that builds it
    mapping: str  # that Auto class's model-type -> class-name table in transformers.models.auto.modeling_auto
    peft_task_type: str | None  # peft's `TaskType` for LoRA on it (None: a plain PeftModel, peft has no task type)


TASK_TABLE = {
    "causal-lm": Task("AutoModelForCausalLM", "MODEL_FOR_CAUSAL_LM_MAPPING_NAMES", "CAUSAL_LM"),
    "seq-cls": Task("AutoModelForSequenceClassification", "MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES",
                    "SEQ_CLS"),
    "seq2seq": Task("AutoModelForSeq2SeqLM", "MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES", "SEQ_2_SEQ_LM"),
    "token-cls": Task("AutoModelForTokenClassification", "MODEL_FOR_TOKEN_CLASSIFICATION_MAPPING_NAMES",
                      "TOKEN_CLS"),
    # images and text (models/vision_language.py); LoRA on the language model is peft's causal-LM task
    "image-text-to-text": Task("AutoModelForImageTextToText", "MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES",
                               "CAUSAL_LM"),
    # Vision, audio and speech (inputs made from the model's config and processor config: models/inputs.py)
    "image-cls": Task("AutoModelForImageClassification", "MODEL_FOR_IMAGE_CLASSIFICATION_MAPPING_NAMES", None),
    "audio-cls": Task("AutoModelForAudioClassification", "MODEL_FOR_AUDIO_CLASSIFICATION_MAPPING_NAMES", None),
    "ctc": Task("AutoModelForCTC", "MODEL_FOR_CTC_MAPPING_NAMES", None),
    "speech-seq2seq": Task("AutoModelForSpeechSeq2Seq", "MODEL_FOR_SPEECH_SEQ_2_SEQ_MAPPING_NAMES", None),
    "multiple-choice": Task("AutoModelForMultipleChoice", "MODEL_FOR_MULTIPLE_CHOICE_MAPPING_NAMES", None),
    "qa": Task("AutoModelForQuestionAnswering", "MODEL_FOR_QUESTION_ANSWERING_MAPPING_NAMES", "QUESTION_ANS"),
}
TASKS = tuple(TASK_TABLE)
# Tasks whose inputs are not (only) token ids: their shapes come from the model's config, its processor
# config and the image / audio flags (models/inputs.py), not from `seq_len` alone.
MEDIA_TASKS = ("image-cls", "audio-cls", "ctc", "speech-seq2seq", "image-text-to-text")
# Of those, the ones whose encoder's sequence the image or audio inputs set (`--seq-len` does not apply); a VLM's
# `seq_len` is its text tokens.
FIXED_SEQUENCE_TASKS = tuple(task for task in MEDIA_TASKS if task != "image-text-to-text")

# The Hub's pipeline tags (what a model page names as its task) for the tasks above, accepted wherever a task is
# named. Speech recognition is CTC or sequence-to-sequence by the model: the first of the two the model builds.
PIPELINE_TAGS = {
    "text-generation": ("causal-lm",),
    "text-classification": ("seq-cls",),
    "token-classification": ("token-cls",),
    "text2text-generation": ("seq2seq",),
    "summarization": ("seq2seq",),
    "translation": ("seq2seq",),
    "image-classification": ("image-cls",),
    "audio-classification": ("audio-cls",),
    "automatic-speech-recognition": ("speech-seq2seq", "ctc"),
    "question-answering": ("qa",),
}


def task_named(name: str | None, supported: tuple[str, ...] | None = None) -> str | None:
    """hf-memfit's task for `name`, one of TASKS or a pipeline tag. A tag of two tasks becomes the first of them in
    `supported` (the model's tasks); it stays as given where the model builds neither, or is not known yet."""
    candidates = PIPELINE_TAGS.get(name)
    if candidates is None:
        return name
    return next((task for task in candidates if len(candidates) == 1 or task in (supported or ())), name)
