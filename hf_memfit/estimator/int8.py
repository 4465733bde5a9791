"""LLM.int8() base weights (`BitsAndBytesConfig(load_in_8bit=True)`) under LoRA: the stand-in layer and its bytes.

What bitsandbytes 0.50 and transformers 5.24 do, read from their code:

- transformers `replace_with_bnb_linear` (integrations/bitsandbytes.py) makes a `bnb.nn.Linear8bitLt` of the same
  modules as for 4-bit (one function, `target_cls = Linear8bitLt if quant_method == "llm_int8" else Linear4bit`;
  quantizer_bnb_8bit.py builds `modules_to_not_convert` exactly as quantizer_bnb_4bit.py), with
  `has_fp16_weights=False` and `threshold=llm_int8_threshold` (6.0). So the packed layers are
  `models.build.bnb_packed_modules`'s, as for 4-bit.
- `Int8Params` (nn/modules.py) holds the weight as int8 `CB` [out, in] (1 B/param) plus `SCB`, one fp32 absmax
  per output row (4 B/row), from `int8_vectorwise_quant`. The bias stays a plain Parameter.
- `Linear8bitLt.forward` does not cast its input (unlike `Linear4bit`): `bnb.matmul(x, weight, bias, state)`
  returns the input's dtype. On CUDA it runs `MatMul8bitLt` (autograd/_functions.py): `A.to(float16)`, then
  `int8_vectorwise_quant` (backends/cuda/ops.py: an int8 copy `CA` [N, K], fp32 row scales [N], and with the
  threshold `A.abs() >= 6.0`, an fp16 and a bool [N, K] temporary), then `int8_mixed_scaled_mm`
  (backends/default/ops.py: `int8_linear_matmul` into int32 [N, M], `int8_mm_dequant` into fp16 [N, M], then
  `.to(A.dtype)`); `CA` is a local of the forward and lives to its end. With a frozen weight only the fast path
  runs (`needs_input_grad[1]` is False: no transposed copy `CAt`), and it keeps `ctx.tensors = (None, subA, A)`:
  the input itself and its outlier columns `subA` [N, n_outliers] (data-dependent; not modelled).
  Its backward never keeps an fp16 weight: `CB.to(A.dtype, copy=True).mul_(SCB/127)` dequantises the whole
  weight in the input's dtype [M, K], then `grad_output @ CB` gives the input's gradient.
- On the CPU, training runs `MatMul8bitFp` instead (`bnb.matmul`: `A.device.type in ("cpu", "xpu")`): the forward
  dequantises the weight to the input's dtype [M, K] and calls `F.linear`; it keeps `ctx.A`; the backward is the
  same dequantise-and-matmul.
- peft `prepare_model_for_kbit_training` (utils/other.py) casts every fp16/bf16 parameter to fp32 but
  `Params4bit`; `Int8Params` are int8, so they are left alone too, while an int8 layer's bias (a plain fp16
  Parameter) is upcast. The residual stream is then fp32, and so is every int8 layer's input and output.

The stand-in: the layer is built in the compute dtype (no int8 on fake tensors), its forward is `int8_matmul.py`'s
`Int8Matmul`,
which allocates what bitsandbytes allocates and keeps what it keeps, and `pack_8bit` puts the int8 storage
and the backward's dequantised weight in by formula (as `sharding._pack_4bit` does for 4-bit).
`models/int8_linear.py` is the same layer in fast mode's ops.
"""

from __future__ import annotations

from hf_memfit.settings import TrainSettings
from hf_memfit.units import format_count

LLM_INT8_THRESHOLD = 6.0  # BitsAndBytesConfig.llm_int8_threshold's default (transformers utils/quantization_config.py)
INT8_BYTES_PER_PARAM = 1  # Int8Params: int8 CB
SCB_BYTES_PER_ROW = 4  # one fp32 absmax per output row (int8_vectorwise_quant's row_stats)


def pack_8bit(rank, step, settings: TrainSettings, hidden_size: int) -> None:
    """The int8 base in place of the traced compute-dtype stand-ins, and the backward's dequantised weight.

    `step.quantizable_linear_params` were traced at 2 B (4 for an fp32 model); they hold 1 B each plus 4 B per
    output row. The rows are counted as params / hidden_size: exact for layers that read the hidden state,
    an over-count for a down projection (its rows are the hidden size), at most 4 B per intermediate row.
    """
    params = step.quantizable_linear_params
    stored = params * INT8_BYTES_PER_PARAM + SCB_BYTES_PER_ROW * params // max(1, hidden_size)
    saved = params * settings.kbit_stand_in_bytes - stored
    # The layer's input dtype: fp32 once peft upcast the residual stream, else the compute dtype.
    in_bytes = 4 if settings.kbit_prepared or settings.compute_dtype == "float32" else 2
    dequant = in_bytes * step.largest_linear_numel  # `CB.to(ctx.dtype_A, copy=True)` in the backward
    for b in rank.candidates.values():
        b["weights"] = max(0, b["weights"] - saved)
        b["temporary"] += dequant
    rank.notes.append(f"LLM.int8() base: 1 B/param + fp32 row scales for {format_count(params)} linear weights; "
                      f"the backward dequantises one weight at a time ({dequant / 2**20:.0f} MiB)")
    if settings.kbit_prepared:
        rank.notes.append("peft's prepare_model_for_kbit_training: what bitsandbytes leaves in half precision "
                          "(embeddings, LM head, norms, the int8 layers' biases) upcast to fp32, so the residual "
                          "stream and every int8 matmul run in fp32 (`--prepare-model-for-kbit-training no` if "
                          "the script does not call it)")
