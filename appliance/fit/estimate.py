"""Whether a model fits a GPU: a pure estimate from its ``config.json`` and weight bytes.

vLLM takes ``gpu_memory_utilization`` of each GPU, loads its share of the weights, keeps
room for a forward pass of ``max_num_batched_tokens`` tokens and its own runtime (CUDA
context, CUDA graphs, NCCL with tensor parallelism), and gives the rest to the KV cache.
It refuses to start when that rest cannot hold one sequence of ``max_model_len`` tokens;
this estimate says so before it starts, with the numbers.

Per token, the KV cache holds a key and a value of every KV head in every layer::

    2 × layers × KV heads per GPU × head size × bytes per element

(MLA models, DeepSeek-V2/V3: one latent of ``kv_lora_rank + qk_rope_head_dim`` per layer,
on every GPU.) Tensor parallelism splits the KV heads between the GPUs (each GPU holds at
least one: with fewer KV heads than GPUs, vLLM copies them) and the weights about evenly.
Quantized weights (AWQ, GPTQ, FP8, ...) shrink the weights, not the KV cache, which
stays in the activation dtype unless ``--kv-cache-dtype fp8`` says otherwise.

Checked against real vLLM on CPU, where the KV space is exactly
``VLLM_CPU_KVCACHE_SPACE``: the per-token size here gives vLLM's own "KV cache size: N
tokens" to within its 16-token blocks (docs/own-model.md). The runtime reserve and the
activation peak are estimates (vLLM profiles them at start); they are a few percent of a
24 GiB card.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any

GIB = 1024**3
DTYPE_BYTES = {
    "float32": 4,
    "float": 4,
    "float16": 2,
    "half": 2,
    "bfloat16": 2,
    "fp8": 1,
    "fp8_e4m3": 1,
    "fp8_e5m2": 1,
}
# vLLM's runtime outside the weights, the KV cache and one forward pass: the CUDA context
# and allocator slack, CUDA graphs; with tensor parallelism, NCCL's buffers too.
RUNTIME_RESERVE_BYTES = GIB
TP_RESERVE_BYTES = GIB // 4
MAX_NUM_SEQS = 256  # vLLM's default: the sampler's logits for this many sequences
ENCODER_TYPES = frozenset(
    {"bert", "roberta", "xlm-roberta", "distilbert", "deberta", "deberta-v2", "electra", "mpnet"}
)


class ShapeError(ValueError):
    """config.json lacks what the estimate needs (says which keys)."""


@dataclass(frozen=True)
class ModelShape:
    """What the estimate needs from a model's config.json."""

    layers: int
    attention_heads: int
    kv_heads: int
    head_dim: int
    hidden_size: int
    intermediate_size: int
    vocab_size: int
    dtype: str  # the activation dtype: the KV cache's unless told otherwise
    weight_bits: float = 16.0  # bits per quantized parameter (16: not quantized)
    quantization: str = ""  # "awq", "gptq", "fp8", ... ("" none)
    experts: int = 0  # routed experts per MoE layer (0: dense)
    expert_intermediate_size: int = 0
    shared_expert_intermediate_size: int = 0
    tie_word_embeddings: bool = False
    kv_latent: int = 0  # MLA: kv_lora_rank + qk_rope_head_dim per layer (0: not MLA)
    max_position_embeddings: int = 0
    encoder_only: bool = False  # BERT and kin: no KV cache to speak of
    architecture: str = ""

    @property
    def dtype_bytes(self) -> int:
        return DTYPE_BYTES.get(self.dtype, 2)

    def kv_bytes_per_token(self, tensor_parallel: int = 1, kv_dtype: str = "") -> int:
        """KV cache bytes one token takes on each GPU of a tensor-parallel group."""
        if self.encoder_only:
            return 0
        elem = DTYPE_BYTES.get(kv_dtype, self.dtype_bytes) if kv_dtype else self.dtype_bytes
        if self.kv_latent:
            return self.layers * self.kv_latent * elem
        heads = max(1, math.ceil(self.kv_heads / tensor_parallel))
        return 2 * self.layers * heads * self.head_dim * elem

    def parameters(self) -> tuple[int, int]:
        """(parameters in the quantizable linear layers, the rest: embeddings, lm_head,
        norms), counted from the shape: for a config.json with no weights beside it."""
        h, q_dim = self.hidden_size, self.attention_heads * self.head_dim
        kv_dim = self.kv_heads * self.head_dim
        attention = h * q_dim + 2 * h * kv_dim + q_dim * h
        if self.experts:
            mlp = self.experts * 3 * h * self.expert_intermediate_size
            mlp += 3 * h * self.shared_expert_intermediate_size + self.experts * h
        else:
            mlp = 3 * h * self.intermediate_size
        linear = self.layers * (attention + mlp)
        embeddings = self.vocab_size * h * (1 if self.tie_word_embeddings else 2)
        return linear, embeddings + self.layers * 2 * h + h

    def estimated_weight_bytes(self) -> int:
        """Weights as the files would hold them: quantized layers at their bits (plus a
        16-bit scale per 128 weights for 4- and 8-bit integer formats), the rest 16-bit."""
        linear, rest = self.parameters()
        per_param = self.weight_bits / 8
        if self.quantization and self.weight_bits < 8.5 and self.quantization != "fp8":
            per_param += 2.25 / 128  # a scale (and a packed zero point) per group of 128
        full = 4 if self.dtype == "float32" else 2
        return int(linear * per_param + rest * full)


def _first(cfg: Mapping[str, Any], *keys: str) -> Any:
    for key in keys:
        if cfg.get(key) is not None:
            return cfg[key]
    return None


def _int(cfg: Mapping[str, Any], *keys: str, default: int | None = None) -> int:
    value = _first(cfg, *keys)
    if isinstance(value, bool) or not isinstance(value, int | float):
        if default is not None:
            return default
        raise ShapeError(f"no {' or '.join(keys)}")
    return int(value)


def _quantization(cfg: Mapping[str, Any], dtype: str) -> tuple[str, float]:
    """(method, bits per weight) from ``quantization_config`` (or ``compression_config``)."""
    q = _first(cfg, "quantization_config", "compression_config")
    if not isinstance(q, Mapping):
        return "", 32.0 if dtype == "float32" else 16.0
    method = str(q.get("quant_method") or q.get("quant_type") or "quantized").lower()
    bits = _first(q, "bits", "w_bit", "weight_bits", "num_bits")
    if bits is None and method == "compressed-tensors":
        for group in (q.get("config_groups") or {}).values():
            weights = group.get("weights") if isinstance(group, Mapping) else None
            if isinstance(weights, Mapping) and weights.get("num_bits"):
                bits = weights["num_bits"]
                break
    if bits is None and method == "bitsandbytes":
        bits = 4 if q.get("load_in_4bit") else 8
    if bits is None and "fp8" in method:
        bits = 8
    return method, float(bits) if isinstance(bits, int | float) else 4.0


def shape_from_config(config: Mapping[str, Any]) -> ModelShape:
    """The shape of a model from its config.json (a multimodal model's text part).
    ShapeError names what is missing."""
    cfg: Mapping[str, Any] = config
    text = config.get("text_config") or config.get("language_config")
    if isinstance(text, Mapping) and "num_hidden_layers" in text:
        cfg = {**config, **text}  # the text model's keys win; dtype may be on either
    model_type = str(cfg.get("model_type") or "")
    archs = cfg.get("architectures") or []
    arch = str(archs[0]) if isinstance(archs, list) and archs else ""
    layers = _int(cfg, "num_hidden_layers", "n_layer", "num_layers", "n_layers")
    heads = _int(cfg, "num_attention_heads", "n_head", "num_heads", "n_heads")
    hidden = _int(cfg, "hidden_size", "n_embd", "d_model", "dim")
    multi_query = 1 if cfg.get("multi_query") is True else heads
    kv_heads = _int(cfg, "num_key_value_heads", "num_kv_heads", "n_head_kv", default=multi_query)
    head_dim = _int(cfg, "head_dim", default=hidden // heads)
    dtype = str(_first(cfg, "torch_dtype", "dtype") or "bfloat16").replace("torch.", "")
    method, bits = _quantization(cfg, dtype)
    kv_lora = _int(cfg, "kv_lora_rank", default=0)
    latent = kv_lora + _int(cfg, "qk_rope_head_dim", default=0) if kv_lora else 0
    experts = _int(cfg, "num_local_experts", "num_experts", "n_routed_experts", default=0)
    intermediate = _int(cfg, "intermediate_size", "n_inner", "ffn_dim", default=4 * hidden)
    shared = _int(cfg, "shared_expert_intermediate_size", default=0)
    if not shared and cfg.get("n_shared_experts"):
        shared = _int(cfg, "n_shared_experts") * _int(cfg, "moe_intermediate_size", default=0)
    return ModelShape(
        layers=layers,
        attention_heads=heads,
        kv_heads=kv_heads,
        head_dim=head_dim,
        hidden_size=hidden,
        intermediate_size=intermediate,
        vocab_size=_int(cfg, "vocab_size", "padded_vocab_size", default=32000),
        dtype=dtype,
        weight_bits=bits,
        quantization=method,
        experts=experts,
        expert_intermediate_size=_int(cfg, "moe_intermediate_size", default=intermediate),
        shared_expert_intermediate_size=shared,
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        kv_latent=latent,
        max_position_embeddings=_int(
            cfg, "max_position_embeddings", "n_positions", "max_seq_len", default=0
        ),
        encoder_only=model_type in ENCODER_TYPES or arch in ("BertModel", "RobertaModel"),
        architecture=arch or model_type,
    )


# ---- the estimate -------------------------------------------------------------------------


@dataclass(frozen=True)
class FitInput:
    """One model on one set of GPUs, as an engine would run it."""

    shape: ModelShape
    weight_bytes: int  # all the weights (every GPU of a tensor-parallel group together)
    gpu_bytes: tuple[int, ...]  # each GPU's total memory (the GPUs of the model)
    context: int  # max_model_len
    gpu_memory_utilization: float = 0.90
    tensor_parallel: int = 1
    max_num_batched_tokens: int = 8192
    kv_dtype: str = ""  # --kv-cache-dtype; "" = the model's dtype
    weights_estimated: bool = False  # from the shape: no weight files were found


@dataclass(frozen=True)
class GpuFit:
    """What one GPU holds."""

    total: int
    budget: int  # total × gpu_memory_utilization
    weights: int  # this GPU's share
    runtime: int  # activation peak + vLLM's reserve
    kv_bytes: int  # left for the KV cache (negative: the weights do not fit)
    kv_tokens: int
    sequences: int  # full sequences of the context

    @property
    def weights_fit(self) -> bool:
        return self.kv_bytes > 0


@dataclass(frozen=True)
class Fit:
    """The verdict for every GPU, and what would help when it does not fit."""

    input: FitInput
    kv_per_token: int  # bytes, on each GPU
    gpus: tuple[GpuFit, ...]
    suggestions: tuple[str, ...] = field(default=())

    @property
    def fits(self) -> bool:
        return bool(self.gpus) and all(g.weights_fit and g.sequences >= 1 for g in self.gpus)

    @property
    def worst(self) -> GpuFit:
        return min(self.gpus, key=lambda g: (g.weights_fit, g.sequences, g.kv_tokens))


def activation_bytes(shape: ModelShape, tensor_parallel: int, batched_tokens: int) -> int:
    """The forward pass vLLM profiles at start: the widest tensors of a layer for
    ``batched_tokens`` tokens (the gated MLP's input and output, the residual stream),
    and the sampler's float32 logits for MAX_NUM_SEQS sequences."""
    width = shape.expert_intermediate_size if shape.experts else shape.intermediate_size
    per_token = (3 * width // tensor_parallel + 4 * shape.hidden_size) * shape.dtype_bytes
    logits = 2 * MAX_NUM_SEQS * shape.vocab_size * 4
    return batched_tokens * per_token + logits


def estimate(fin: FitInput) -> Fit:
    """How much of each GPU the weights, the runtime and the KV cache take."""
    tp = max(1, fin.tensor_parallel)
    per_token = fin.shape.kv_bytes_per_token(tp, fin.kv_dtype)
    weights = math.ceil(fin.weight_bytes / tp)
    runtime = activation_bytes(fin.shape, tp, fin.max_num_batched_tokens)
    runtime += RUNTIME_RESERVE_BYTES + (TP_RESERVE_BYTES if tp > 1 else 0)
    gpus = []
    for total in fin.gpu_bytes:
        budget = int(total * fin.gpu_memory_utilization)
        kv = budget - weights - runtime
        tokens = kv // per_token if per_token and kv > 0 else 0
        # An encoder keeps no KV cache: a sequence needs only its forward pass.
        sequences = 1 if fin.shape.encoder_only and kv > 0 else tokens // fin.context
        gpus.append(GpuFit(total, budget, weights, runtime, kv, tokens, sequences))
    fit = Fit(fin, per_token, tuple(gpus))
    return fit if fit.fits else replace(fit, suggestions=tuple(suggest(fit)))


# ---- what to try when it does not fit ---------------------------------------------------


def _with(fin: FitInput, **changes: Any) -> Fit:
    return estimate(replace(fin, **changes))


def suggest(fit: Fit) -> list[str]:
    """What would make it fit, each checked with the same estimate: tensor parallelism
    over more of the GPUs, a shorter context, an FP8 KV cache, a 4-bit variant."""
    fin, worst, out = fit.input, fit.worst, []
    for tp in _tp_choices(fin)[1:]:
        trial = _with(fin, tensor_parallel=tp)
        if trial.fits:
            w = trial.worst
            out.append(
                f"tensor_parallel_size = {tp} (one engine over {tp} GPUs): "
                f"{gib(w.weights)} of weights per GPU, KV cache for {w.kv_tokens:,} tokens "
                f"({w.sequences} sequence(s) of {fin.context:,})"
            )
            break
    if worst.weights_fit and worst.sequences < 1 and worst.kv_tokens >= 1024:
        longest = (worst.kv_tokens // 1024) * 1024
        out.append(f"max_model_len = {longest:,} (what the KV cache holds on the smallest GPU)")
    short = worst.weights_fit and worst.sequences < 1
    if short and not fin.kv_dtype and _with(fin, kv_dtype="fp8").fits:
        out.append('an FP8 KV cache (extra_args = ["--kv-cache-dtype", "fp8"]): half the bytes')
    if fin.shape.weight_bits > 4.5:
        out += _four_bit(fin)
    utilization = fin.gpu_memory_utilization
    if not out and utilization < 0.95 and _with(fin, gpu_memory_utilization=0.95).fits:
        out.append("gpu_memory_utilization = 0.95 (if nothing else uses the GPU)")
    if not out:
        out.append("a smaller model, or GPUs with more memory")
    return out


def _tp_choices(fin: FitInput) -> list[int]:
    """The tensor parallel sizes worth a try: this one, then more over the GPUs there are."""
    more = [tp for tp in (2, 4, 8) if tp > fin.tensor_parallel and tp <= len(fin.gpu_bytes)]
    return [fin.tensor_parallel, *(tp for tp in more if fin.shape.attention_heads % tp == 0)]


def _four_bit(fin: FitInput) -> list[str]:
    """A 4-bit variant of the model, at the smallest tensor parallel size it fits."""
    bits4 = replace(fin.shape, weight_bits=4.0, quantization="awq")
    size = bits4.estimated_weight_bytes()
    for tp in _tp_choices(fin):
        trial = _with(fin, shape=bits4, weight_bytes=size, tensor_parallel=tp)
        if trial.fits:
            over = f", with tensor_parallel_size = {tp}" if tp != fin.tensor_parallel else ""
            return [f"a 4-bit quantized variant (AWQ or GPTQ, about {gib(size)} of weights){over}"]
    return []


def gib(n: float) -> str:
    return f"{n / GIB:.1f} GiB"
