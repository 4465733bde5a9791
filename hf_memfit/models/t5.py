"""T5: encoder-decoder, relative-position bias, RMSNorm, tied head.

Everything hf-memfit knows by hand about the family: the transformers 5.23 config
defaults (a published config.json leaves out keys equal to them), peft's default
LoRA targets, the normalised fields, the linear modules, the parameter counts
and the symbolic forward fast mode runs.
"""


from __future__ import annotations

from dataclasses import replace

from typing import Any

from hf_memfit.models.forward import FamilyForward
from hf_memfit.models._shared import Getter, Lin, common, head_linears, head_params, pos_int

MODEL_TYPES = ('t5',)

# Linear layers bitsandbytes leaves unpacked on a 4-bit model: transformers 5.24 `T5PreTrainedModel.
# _keep_in_fp32_modules = ["wo"]` (modeling_t5.py), which its 4-bit quantizer adds to `modules_to_not_convert`;
# they load in the checkpoint's dtype. Exact mode reads the class attribute (`step.quantizable_linears`).
UNPACKED_4BIT = ("wo",)

DEFAULTS: dict[str, dict[str, Any]] = {
    "t5": {
        "vocab_size": 32128, "d_model": 512, "d_kv": 64, "d_ff": 2048, "num_layers": 6, "num_decoder_layers": None,
        "num_heads": 8, "relative_attention_num_buckets": 32, "dropout_rate": 0.1, "feed_forward_proj": "relu"
    },
}

ALIASES: dict[str, dict[str, str]] = {
    "t5": {
        "d_model": "hidden_size", "num_heads": "num_attention_heads", "num_layers": "num_hidden_layers", "d_kv":
        "head_dim"
    },
}

# peft 0.21's TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING for these types (tests compare).
PEFT_LORA_TARGETS: dict[str, list[str]] = {
    "t5": ["q", "v"],
}


def _t5_ff(get: Getter) -> tuple[str, bool]:
    # transformers: "gated-gelu" -> gated, activation gelu_new; "relu" -> plain relu.
    proj = get("feed_forward_proj")
    parts = proj.split("-")
    gated = parts[0] == "gated"
    act = "gelu_new" if proj == "gated-gelu" else parts[-1]
    return act, gated


def fields(get: Getter) -> dict[str, Any]:
    h, heads = get("d_model"), get("num_heads")
    enc = get("num_layers")
    dec = get("num_decoder_layers")
    act, gated = _t5_ff(get)
    drop = float(get("dropout_rate"))
    return {
        **common(get, h, enc, heads),
        "num_decoder_layers": pos_int(enc if dec is None else dec, "num_decoder_layers"),
        "num_key_value_heads": heads,
        "head_dim": get("d_kv"),
        "intermediate_size": get("d_ff"),
        "max_position_embeddings": None,  # relative position buckets: no learned limit
        # transformers 5 always ties T5's lm_head to the shared embedding
        # (T5Config forces tie_word_embeddings=True, even for v1.1 configs).
        "tie_word_embeddings": True,
        "is_encoder_decoder": True,
        "default_task": "seq2seq",
        "supported_tasks": ("seq2seq",),
        "layer_count_keys": (get.key("num_layers"), "num_decoder_layers"),
        "hidden_act": act,
        "gated_mlp": gated, "norm_type": "rmsnorm", "norms_per_layer": 3, "fused_qkv": False,
        "qkv_bias": False, "attn_out_bias": False, "mlp_bias": False,
        "attention_dropout": drop, "hidden_dropout": drop, "embedding_dropout": drop,
        "activation_dropout": drop,
        "sliding_window": None, "layer_period": 1, "embedding_dim": h,
    }


def linears(s, get: Getter, task: str, num_labels: int) -> list[Lin]:
    h, f = s.hidden_size, s.intermediate_size
    inner = s.num_attention_heads * s.head_dim
    enc, dec = s.num_layers, s.num_decoder_layers
    attn = enc + 2 * dec  # encoder self, decoder self and decoder cross attention
    ff = enc + dec
    out = [(p, h, inner, False, attn, "layer") for p in ("q", "k", "v")]
    out.append(("o", inner, h, False, attn, "layer"))
    if s.gated_mlp:
        out += [("wi_0", h, f, False, ff, "layer"), ("wi_1", h, f, False, ff, "layer")]
    else:
        out.append(("wi", h, f, False, ff, "layer"))
    out.append(("wo", f, h, False, ff, "layer"))
    out += head_linears(s, task, num_labels, h)
    return out


def counts(s, get: Getter, task: str, num_labels: int) -> dict[str, int]:
    h, f = s.hidden_size, s.intermediate_size
    inner = s.num_attention_heads * s.head_dim
    attn = 4 * h * inner + h  # q, k, v, o and the layer's RMSNorm weight
    ff = (3 if s.gated_mlp else 2) * h * f + h
    per_enc, per_dec = attn + ff, 2 * attn + ff
    # Layer 0 of each stack owns a relative-position bias table; it is counted
    # with the embeddings so every layer of a stack has the same size.
    relative = 2 * get("relative_attention_num_buckets") * s.num_attention_heads
    entries = linears(s, get, task, num_labels)
    return {
        "embedding": s.vocab_size * h + relative,
        "per_layer": per_dec,
        "per_encoder_layer": per_enc,
        "per_decoder_layer": per_dec,
        "layers": per_enc * s.num_layers + per_dec * s.num_decoder_layers,
        "final": 2 * h,  # encoder and decoder final RMSNorms
        "head": head_params(s, entries, task),
    }


def embedding_tables(spec) -> list[tuple[int, int, bool]]:
    """(rows, cols, decay): the shared token table and each stack's relative_attention_bias (layer 0).

    "bias" in the relative tables' names keeps them out of weight decay.
    """
    buckets = spec.config.get("relative_attention_num_buckets", 32)
    heads = spec.num_attention_heads
    return [(spec.vocab_size, spec.hidden_size, True), (buckets, heads, False), (buckets, heads, False)]


# The symbolic forward fast mode runs (models/forward.py): the ops transformers 5.23 runs, in order.
class Forward(FamilyForward):
    """T5: relative-position bias from layer 0 of each stack, RMS norms, dropout everywhere."""

    def embed(self):
        f = self.f
        x = self.token_embedding(self.h)
        return f.dropout(x, self.spec.embedding_dropout)

    def _bias(self, kv_len: int, relative: bool, causal: bool):
        """The position bias of a stack's layer 0 (shared by the stack), [1, heads, s, kv]."""
        f, nh, s = self.f, self.spec.num_attention_heads, self.ctx.s
        if relative:
            buckets = f.new(s * kv_len, "i64", False)
            f.save(buckets)  # the embedding lookup's indices
            bias = f.new(nh * s * kv_len, self.rdt, self.ctx.full_ft)
        else:
            # torch.zeros((1, heads, s, kv), dtype=query_states.dtype)
            bias = f.new(nh * s * kv_len, self.ctx.ac or self.rdt, False)
        f.hold(bias)
        return bias

    def _mask(self, bias, causal):
        """create_position_bias_mask: the bias itself, or where(causal, bias, min) (saving the bool mask)."""
        f = self.f
        if self.ctx.attn == "eager":
            return bias
        if not causal:
            return bias
        cond = f.new(self.ctx.s * self.ctx.s, "bool", False)
        f.save(cond)
        return f.new(bias.numel, bias.dtype, bias.rg, inputs=(bias, cond))

    def _attn(self, x, kv_src, bias, causal, cache):
        f, s, h, T = self.f, self.spec, self.h, self.T
        nh, hd = s.num_attention_heads, s.head_dim
        inner = nh * hd
        q = f.linear(x, h, inner, "q", False)
        k = f.linear(kv_src, h, inner, "k", False)
        v = f.linear(kv_src, h, inner, "v", False)
        if cache:
            k, v = f.kv_cache(k, v)
        mask = self._mask(bias, causal)
        if self.ctx.attn == "eager":
            o = f.attention(q, k, v, nh, nh, hd, dropout=s.attention_dropout, mask=mask, causal=causal,
                            eager_style="bert")
        else:
            o = f.attention(q, k, v, nh, nh, hd, dropout=s.attention_dropout, mask=mask, causal=False)
        return f.linear(o, inner, h, "o", False)

    def _ff(self, x):
        f, s, h, i = self.f, self.spec, self.h, self.spec.intermediate_size
        n = f.rms_norm(x, h, "t5")
        if s.gated_mlp:
            g = f.activation(f.linear(n, h, i, "wi_0", False), s.hidden_act)
            m = f.mul(g, f.linear(n, h, i, "wi_1", False))
        else:
            m = f.activation(f.linear(n, h, i, "wi", False), s.hidden_act)
        m = f.dropout(m, s.activation_dropout)
        if m.dtype != self.ctx.wdt:
            m = f.cast(m, self.ctx.wdt)  # hidden_states.to(self.wo.weight.dtype)
        m = f.linear(m, i, h, "wo", False)
        return f.add(x, f.dropout(m, s.hidden_dropout))

    def encoder_layer(self, x, index):
        f, s, h = self.f, self.spec, self.h
        if index == 0:
            self.enc_bias = self._bias(self.ctx.s, True, False)
        n = f.rms_norm(x, h, "t5")
        o = self._attn(n, n, self.enc_bias, False, cache=False)
        x = f.add(x, f.dropout(o, s.hidden_dropout))
        return self._ff(x)

    def encoder_final(self, x):
        f = self.f
        x = f.rms_norm(x, self.h, "t5")
        return f.dropout(x, self.spec.hidden_dropout)

    def start_decoder(self):
        """The decoder runs at the labels' length (`decoder_s`); cross-attention keys keep the encoder's."""
        self.encoder_s = self.ctx.s
        if self.ctx.decoder_s is not None:
            self.ctx = self.f.ctx = replace(self.ctx, s=self.ctx.decoder_s)
            self.T = self.ctx.tokens

    def decoder_layer(self, x, index, enc):
        f, s, h = self.f, self.spec, self.h
        if index == 0:
            self.dec_bias = self._bias(self.ctx.s, True, True)
            self.cross_bias = None
        n = f.rms_norm(x, h, "t5")
        o = self._attn(n, n, self.dec_bias, True, cache=True)
        x = f.add(x, f.dropout(o, s.hidden_dropout))
        n = f.rms_norm(x, h, "t5")
        if self.cross_bias is None:
            self.cross_bias = self._bias(self.encoder_s, False, False)
        o = self._attn(n, enc, self.cross_bias, False, cache=True)
        x = f.add(x, f.dropout(o, s.hidden_dropout))
        return self._ff(x)

    def final(self, x):
        f = self.f
        x = f.rms_norm(x, self.h, "t5")
        x = f.dropout(x, self.spec.hidden_dropout)
        return f.scale(x)  # sequence_output * model_dim**-0.5 (tied lm_head)
