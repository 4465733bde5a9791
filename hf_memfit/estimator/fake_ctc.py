"""CTC's loss on fake tensors: the same tensors as transformers' `ForCTCLoss` and torch's CPU / CUDA kernels.

A `*ForCTC` model (wav2vec2, HuBERT, ...) cannot run its loss on fake tensors: its forward first checks
`labels.max() >= vocab_size` (a value), `ForCTCLoss` selects the labels by a mask (`masked_select`: a
shape from the data), and `aten._ctc_loss` itself is registered as having a data-dependent output. The
batch exact mode traces has no padding in its labels (every row is `label_len` characters and every
clip the full window), so all three are known: the trace runs the model without `labels` and adds the
loss here with static shapes and the same allocations:

- forward (aten/src/ATen/native/LossCTC.cpp, `ctc_loss_cpu_template`; the CUDA kernel keeps the same):
  the float32 log-softmax of the logits (T x b x vocab, `ForCTCLoss`), `log_alpha` (b x T x (2L + 1)) and
  the per-row negative log-likelihood, both saved for backward with the log-probs and the targets;
- backward (`ctc_loss_backward_cpu_template`): `log_beta` (b x T x (2L + 1)), transient, and the gradient
  of the log-probs (T x b x vocab);
- and around it, as `Wav2Vec2ForCTC.forward` does: an int64 attention mask of ones over the raw samples
  (b x samples) when none is given, the label mask and the selected (flattened) labels.
"""

from __future__ import annotations

import contextlib

import torch


class _StaticCTC(torch.autograd.Function):
    @staticmethod
    def forward(ctx, log_probs, targets, label_len: int):
        frames, rows, _ = log_probs.shape
        log_alpha = log_probs.new_empty(rows, frames, 2 * label_len + 1)
        nll = log_probs.new_zeros(rows)
        ctx.save_for_backward(log_probs, targets, nll, log_alpha)
        ctx.label_len = label_len
        return nll

    @staticmethod
    def backward(ctx, grad_nll):
        log_probs, _, _, log_alpha = ctx.saved_tensors
        log_beta = torch.empty_like(log_alpha)
        grad = torch.empty_like(log_probs)
        del log_beta
        return grad, None, None


def _is_ctc(model) -> bool:
    return type(model).__name__.endswith("ForCTC") and hasattr(model, "_get_feat_extract_output_lengths")


@contextlib.contextmanager
def static_ctc_loss(model):
    """For a `*ForCTC` model (under any peft wrapping): its loss with static shapes, for the trace's batch."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    if not _is_ctc(base):
        yield
        return
    forward = base.forward
    config = base.config

    def with_loss(input_values=None, attention_mask=None, labels=None, **kwargs):
        outputs = forward(input_values, attention_mask=attention_mask, **kwargs)
        if labels is None:
            return outputs
        mask = attention_mask if attention_mask is not None else torch.ones_like(input_values, dtype=torch.long)
        lengths = base._get_feat_extract_output_lengths(mask.sum(-1)).to(torch.long)
        labels_mask = (labels != -100) & (labels != config.pad_token_id)
        target_lengths = labels_mask.sum(-1)
        flattened = labels.flatten().clone()  # masked_select of labels that are all valid
        log_probs = torch.nn.functional.log_softmax(outputs.logits, dim=-1, dtype=torch.float32).transpose(0, 1)
        nll = _StaticCTC.apply(log_probs, flattened, labels.shape[1])
        if config.ctc_zero_infinity:
            nll = torch.where(nll == torch.inf, torch.zeros_like(nll), nll)
        if config.ctc_loss_reduction == "mean":
            loss = (nll / target_lengths.clamp(min=1)).mean()
        else:
            loss = nll.sum()
        del lengths
        outputs.loss = loss
        return outputs

    base.forward = with_loss
    try:
        yield
    finally:
        del base.forward  # the class's own forward again
