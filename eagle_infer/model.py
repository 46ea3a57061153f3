"""The target model: a Llama-family / Qwen2 / Qwen3 / Phi-3 / Gemma / Gemma 2 / Gemma 3 decoder with a
static KV cache.

Everything the speculative runtime asks of the target is here and nothing more:
  * one preallocated cache for all layers, [layers, 2, batch, kv_heads, max_seq_len, head_dim],
    written at explicit per-token slots, with explicit per-token RoPE positions (a tree node's
    slot and position differ: slot = prefix + node index, position = prefix + depth);
  * an attention mask over (new tokens x cache slots), so a whole draft tree is scored in one
    call;
  * logits only where asked, and the hidden states of the layers asked for;
  * `keep_slots`, which moves the accepted path's cache entries to contiguous slots (one
    gather and one scatter over every layer at once).

What depends only on the step (RoPE cos/sin at the positions, the additive attention mask,
the cache write indices) is computed once per forward and shared by all layers: eager
dispatch costs a few microseconds per op, and a 30-layer step is thousands of ops.

Shapes: B batch, T new tokens, S cache slots (kv_len), H hidden, V vocab, D head dim.
Hidden-state indices follow Hugging Face `output_hidden_states`: index i is the input of
layer i (0 = embeddings) and index N (= num_layers) is the final, normed state.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from eagle_infer.errors import UserError
from eagle_infer.kernels import avx2_attention, decoder_layers

SUPPORTED_MODEL_TYPES = ("gemma", "gemma2", "gemma3_text", "llama", "mistral", "phi3", "qwen2", "qwen3")
ACTIVATIONS = ("silu", "gelu_pytorch_tanh")


@dataclass
class ModelConfig:
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    rotary_dim: int = 0  # the head dims RoPE turns (Phi-4-mini's partial rotary); 0 = head_dim
    max_position_embeddings: int = 4096  # the context served
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    qk_norm: bool = False  # Qwen3, Gemma 3: RMSNorm over each head's queries and keys before RoPE
    hidden_act: str = "silu"  # the MLP's gate: silu, or gelu_pytorch_tanh (Gemma)
    norm_offset: float = 0.0  # Gemma: every RMSNorm scales by offset + weight, in fp32
    embed_scale: float = 0.0  # Gemma: the embeddings times this (sqrt(hidden)); 0 = not scaled
    sandwich_norms: bool = False  # Gemma 2/3: norms on attention's and the MLP's outputs, one before the MLP
    query_scale: float = 0.0  # scores' scale, 0 = 1/sqrt(head_dim) (Gemma 2/3: query_pre_attn_scalar^-0.5)
    attn_softcap: float = 0.0  # Gemma 2: scores capped by cap * tanh(score / cap) before the mask
    final_softcap: float = 0.0  # Gemma 2: the logits likewise
    sliding_window: int = 0  # the layers in sliding_layers see their sliding_window latest positions
    sliding_layers: tuple[int, ...] = ()
    local_rope_theta: float = 0.0  # Gemma 3: the sliding layers' RoPE base (plain RoPE); 0 = the others'
    eos_token_ids: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.rotary_dim = self.rotary_dim or self.head_dim
        if self.rotary_dim % 2 or (self.head_dim - self.rotary_dim) % 2:
            raise UserError(f"rotary dims {self.rotary_dim} of head size {self.head_dim}: "
                            "both halves must be even")

    def long_rope_from(self) -> int:
        """LongRoPE's original context (0: not LongRoPE): a sequence that may grow longer turns
        with the long factors throughout, others with the short ones (Transformer.start_rows)."""
        scaling = self.rope_scaling or {}
        return scaling["original_max_position_embeddings"] if scaling.get("rope_type") == "longrope" else 0

    def window_everywhere(self) -> bool:
        """Every layer slides over the same window with the same RoPE (Mistral-7B-v0.1's, Phi-3's):
        one mask serves them all, the window folded into it."""
        return len(self.sliding_layers) == self.num_layers > 0 and not self.local_rope_theta

    def fused_layers_compute(self) -> bool:
        """The layers are what kernels/decoder_layers computes: Llama's, with Qwen2's biases, Qwen3's
        query/key norms, a partial rotary or one window for all (it reads the mask given), and
        Gemma's and Gemma 3's (offset norms, sandwich norms, tanh GELU, a score scale, sliding
        layers with a mask and RoPE of their own); not Gemma 2's soft-capped scores."""
        return self.hidden_act in ACTIVATIONS and not self.attn_softcap

    @classmethod
    def from_hf(cls, cfg: dict[str, Any]) -> ModelConfig:
        model_type = cfg.get("model_type", "")
        if model_type == "gemma3" and "text_config" in cfg:
            cfg, model_type = gemma3_text_config(cfg), "gemma3_text"
        if model_type not in SUPPORTED_MODEL_TYPES:
            arch = (cfg.get("architectures") or ["?"])[0]
            raise UserError(
                f"unsupported architecture: model_type '{model_type}' ({arch}); "
                f"supported: {', '.join(SUPPORTED_MODEL_TYPES)}"
            )
        max_positions = cfg.get("max_position_embeddings", 4096)
        extra: dict[str, Any] = {}
        window = cfg.get("sliding_window")
        if window and window < max_positions and model_type not in ("gemma", "gemma2", "gemma3_text") \
                and cfg.get("use_sliding_window", model_type in ("mistral", "phi3")):
            # Mistral's and Phi-3's layers all slide; Qwen2/3's from max_window_layers on
            # (transformers' layer_types where the config has none)
            first = cfg.get("max_window_layers", 28) if model_type in ("qwen2", "qwen3") else 0
            extra = dict(sliding_window=window, sliding_layers=sliding_layers(cfg, lambda i: i >= first))
        # transformers >= 5 keeps rope settings in `rope_parameters`; older configs use
        # `rope_theta` + `rope_scaling`.
        rope = dict(cfg.get("rope_parameters") or {})
        scaling = cfg.get("rope_scaling") or None
        if rope and rope.get("rope_type", "default") != "default":
            scaling = rope
        theta = rope.get("rope_theta", cfg.get("rope_theta", 10000.0))
        if scaling and scaling.get("rope_type", scaling.get("type")) in ("longrope", "su", "yarn") \
                and model_type == "phi3":  # Phi-3's older names of its LongRoPE (transformers' rule)
            original = scaling.get("original_max_position_embeddings",
                                   cfg.get("original_max_position_embeddings", max_positions))
            scaling = {**scaling, "rope_type": "longrope", "original_max_position_embeddings": original,
                       "factor": scaling.get("factor") or cfg.get("max_position_embeddings", 4096) / original}
        eos = cfg.get("eos_token_id")
        eos_ids = [eos] if isinstance(eos, int) else list(eos or [])
        n_heads = cfg["num_attention_heads"]
        head_dim = cfg.get("head_dim") or cfg["hidden_size"] // n_heads
        partial = rope.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 1.0))
        gemma = model_type in ("gemma", "gemma2", "gemma3_text")
        act = (cfg.get("hidden_activation") or cfg.get("hidden_act") or "gelu_pytorch_tanh") if gemma \
            else cfg.get("hidden_act", "silu")
        act = "gelu_pytorch_tanh" if gemma and act == "gelu" else act  # Gemma's "gelu": tanh's (transformers)
        if act not in ACTIVATIONS:
            raise UserError(f"unsupported activation: hidden_act '{act}' ({model_type}); "
                            f"supported: {', '.join(ACTIVATIONS)}")
        if model_type == "gemma3_text":
            extra, theta, scaling = gemma3_layers(cfg)
        elif model_type == "gemma2":
            extra = gemma2_layers(cfg)
        return cls(
            model_type=model_type,
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_layers=cfg["num_hidden_layers"],
            num_heads=n_heads,
            num_kv_heads=cfg.get("num_key_value_heads") or n_heads,
            head_dim=head_dim,
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_theta=float(theta),
            rope_scaling=scaling,
            rotary_dim=int(head_dim * partial),
            max_position_embeddings=max_positions,
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            attention_bias=bool(cfg.get("attention_bias", model_type == "qwen2")),
            qk_norm=model_type in ("qwen3", "gemma3_text"),
            hidden_act=act,
            norm_offset=1.0 if gemma else 0.0,
            embed_scale=cfg["hidden_size"] ** 0.5 if gemma else 0.0,
            eos_token_ids=eos_ids,
            **extra,
        )

    def eagle3_layer_ids(self) -> list[int]:
        """Hidden-state indices EAGLE-3 reads: the inputs of layers 2, N/2 and N-3."""
        n = self.num_layers
        return [2, n // 2, n - 3]


def gemma3_text_config(cfg: dict[str, Any]) -> dict[str, Any]:
    """The language model's config of a Gemma 3 with its vision tower (4B and up): its text_config,
    which the Hub's configs keep to what differs from transformers' defaults, completed by
    transformers' Gemma3TextConfig; the tower is not loaded (text in, text out)."""
    from transformers import Gemma3TextConfig

    text = Gemma3TextConfig(**{k: v for k, v in cfg["text_config"].items() if k != "model_type"}).to_dict()
    for key in ("eos_token_id", "bos_token_id", "tie_word_embeddings"):
        if key in cfg and cfg[key] is not None:
            text[key] = cfg[key]
    return {**text, "model_type": "gemma3_text", "architectures": cfg.get("architectures")}


def sliding_layers(cfg: dict[str, Any], slides: Callable[[int], bool]) -> tuple[int, ...]:
    """The layers a config's layer_types make sliding (in older configs, the layers i that
    slides(i) picks: transformers' rule for the model); none without a window."""
    if not cfg.get("sliding_window"):
        return ()
    types = cfg.get("layer_types") or ["sliding_attention" if slides(i) else "full_attention"
                                       for i in range(cfg["num_hidden_layers"])]
    return tuple(i for i, t in enumerate(types) if t == "sliding_attention")


def sandwich_layers(cfg: dict[str, Any], slides: Callable[[int], bool]) -> dict[str, Any]:
    """What Gemma 2's and Gemma 3's layers share (ModelConfig fields): norms on the attention's and
    the MLP's outputs, query_pre_attn_scalar's score scale, and the sliding layers (sliding_layers)."""
    return dict(sandwich_norms=True, query_scale=cfg.get("query_pre_attn_scalar", 256) ** -0.5,
                sliding_window=cfg.get("sliding_window") or 0, sliding_layers=sliding_layers(cfg, slides))


def gemma2_layers(cfg: dict[str, Any]) -> dict[str, Any]:
    """Gemma 2's layers (ModelConfig fields): Gemma 3's without query/key norms and with one RoPE,
    every other layer sliding, and attention scores and logits soft-capped."""
    return dict(sandwich_layers(cfg, lambda i: i % 2 == 0),
                attn_softcap=float(cfg.get("attn_logit_softcapping") or 0.0),
                final_softcap=float(cfg.get("final_logit_softcapping") or 0.0))


def gemma3_layers(cfg: dict[str, Any]) -> tuple[dict[str, Any], float, dict[str, Any] | None]:
    """Gemma 3's (text) layers from its config: (ModelConfig fields, the full-attention layers'
    rope_theta and rope scaling). Its sliding layers (5 of 6) see the sliding_window latest slots
    with plain RoPE of their own base; transformers 5 keeps the two ropes in rope_parameters by
    layer type, older configs in rope_theta / rope_scaling and rope_local_base_freq."""
    if cfg.get("use_bidirectional_attention"):
        raise UserError("unsupported: use_bidirectional_attention (EmbeddingGemma): not a causal LM")
    pattern = cfg.get("sliding_window_pattern", 6)  # every pattern-th layer full
    params = cfg.get("rope_parameters") or {}
    if "full_attention" in params:
        full, local = params["full_attention"] or {}, params.get("sliding_attention") or {}
    else:
        full = {**(cfg.get("rope_scaling") or {}), "rope_theta": cfg.get("rope_theta", 1e6)}
        local = {"rope_type": "default", "rope_theta": cfg.get("rope_local_base_freq", 1e4)}
    if local.get("rope_type", local.get("type", "default")) != "default":
        raise UserError(f"unsupported: Gemma 3 sliding layers' rope type '{local.get('rope_type')}'")
    scaling = full if full.get("rope_type", full.get("type", "default")) != "default" else None
    fields = dict(sandwich_layers(cfg, lambda i: (i + 1) % pattern != 0),
                  local_rope_theta=float(local.get("rope_theta", 1e4)))
    return fields, float(full.get("rope_theta", 1e6)), scaling


# ---------------------------------------------------------------------------------------
# Rotary embedding


def rope_inv_freq(cfg: ModelConfig, long: bool = False) -> Tensor:
    """Inverse frequencies [rotary_dim/2], with Llama-3 / linear / LongRoPE (its short factors, or
    its long ones where `long`) scaling when the config asks."""
    d = cfg.rotary_dim
    inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d))
    scaling = cfg.rope_scaling or {}
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind == "default":
        return inv_freq.float()
    if kind == "linear":
        return (inv_freq / scaling["factor"]).float()
    if kind == "longrope":
        factors = scaling["long_factor" if long else "short_factor"]
        return (inv_freq / torch.tensor(factors, dtype=torch.float64)).float()
    if kind == "llama3":
        factor = scaling["factor"]
        low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
        old_ctx = scaling["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv_freq
        smooth = (old_ctx / wavelen - low) / (high - low)
        scaled = torch.where(wavelen > old_ctx / low, inv_freq / factor, inv_freq)
        mid = (1 - smooth) * scaled / factor + smooth * scaled
        is_mid = (wavelen <= old_ctx / low) & (wavelen >= old_ctx / high)
        return torch.where(is_mid, mid, scaled).float()
    raise UserError(f"unsupported rope scaling type '{kind}'")


def rope_attention_factor(cfg: ModelConfig) -> float:
    """What LongRoPE multiplies cos and sin by (transformers' default where the config has none)."""
    scaling = cfg.rope_scaling or {}
    if scaling.get("rope_type") != "longrope":
        return 1.0
    if scaling.get("attention_factor") is not None:
        return float(scaling["attention_factor"])
    factor = scaling["factor"]
    original = scaling["original_max_position_embeddings"]
    return 1.0 if factor <= 1 else math.sqrt(1 + math.log(factor) / math.log(original))


def rope_tables(cfg: ModelConfig, max_pos: int) -> tuple[Tensor, Tensor]:
    """cos, sin tables [max_pos, D] in fp32 (rotate-half layout, as HF checkpoints use). With a
    partial rotary the dims RoPE does not turn sit in the middle of each half with cos 1, sin 0
    (convert_hf_state_dict moves them there: `rotary_order`). LongRoPE's are [2 max_pos, D]: rows
    0.. turn with the short factors, rows max_pos.. with the long ones (a sequence's half:
    Transformer.start_rows)."""
    inv_freq = rope_inv_freq(cfg)
    still = cfg.head_dim // 2 - inv_freq.numel()
    t = torch.arange(max_pos, dtype=torch.float32)
    freqs = torch.outer(t, inv_freq)
    if cfg.long_rope_from():
        freqs = torch.cat([freqs, torch.outer(t, rope_inv_freq(cfg, long=True))])
        t = torch.arange(2 * max_pos)
    turned = torch.cat([torch.ones_like(inv_freq), torch.zeros(still)]).repeat(2).bool()  # [D]
    emb = torch.cat([freqs, freqs.new_zeros(len(t), still)], -1).repeat(1, 2)
    factor = rope_attention_factor(cfg)
    scale = torch.where(turned, factor, 1.0)
    return emb.cos() * scale, emb.sin() * scale


def rotary_order(cfg: ModelConfig) -> Tensor:
    """Index [D] into a checkpoint's query / key head dims that puts them in the order rope_tables
    turns: a partial rotary turns dims 0..R-1 in rotate-half pairs (j, j + R/2) and leaves R..D-1;
    ours pairs (j, j + D/2) over the whole head, so the turned halves go first in each half of the
    head and the still dims after them. Queries and keys reorder alike, so their dot products,
    and the attention, are the checkpoint's."""
    D, R = cfg.head_dim, cfg.rotary_dim
    rot, still = torch.arange(R), torch.arange(R, D)
    return torch.cat([rot[: R // 2], still[: (D - R) // 2], rot[R // 2:], still[(D - R) // 2:]])


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """x [B, T, heads, D]; cos/sin [B, T, D] already gathered at the tokens' positions."""
    cos, sin = cos.unsqueeze(2).to(x.dtype), sin.unsqueeze(2).to(x.dtype)
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat([-x2, x1], dim=-1) * sin


def rope_at(cos_table: Tensor, sin_table: Tensor, positions: Tensor,
            dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """cos, signed sin [B, T, 1, D] at positions [B, T], for `rotate`: gathered once per step.
    The sign of rotate-half's negated half is folded into sin (exact: -(a*b) == a*(-b))."""
    half = cos_table.shape[-1] // 2
    cos, sin = cos_table[positions], sin_table[positions]
    sin = torch.cat([-sin[..., :half], sin[..., half:]], -1)
    return cos[:, :, None].to(dtype), sin[:, :, None].to(dtype)


def rotate(x: Tensor, cos: Tensor, signed_sin: Tensor) -> Tensor:
    """apply_rope with tables from rope_at: x [B, T, heads, D]."""
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat([x2, x1], dim=-1) * signed_sin


# ---------------------------------------------------------------------------------------
# Masks


def build_attn_mask(prefix_len: Tensor, local_mask: Tensor, kv_len: int) -> Tensor:
    """Attention mask [B, T, kv_len] for T new tokens whose window of W slots starts at
    prefix_len (the new tokens are written somewhere in that window).

    Each new token sees every slot below its sequence's prefix_len, and the window slots that
    `local_mask` [B, T, W] (or [T, W]) allows: lower-triangular for a chain, ancestors for a
    tree.
    """
    B, (T, W) = prefix_len.shape[0], local_mask.shape[-2:]
    local_mask = local_mask.expand(B, T, W)
    rel = torch.arange(kv_len, device=prefix_len.device)[None, :] - prefix_len[:, None]  # [B,S]
    in_window = (rel >= 0) & (rel < W)
    idx = rel.clamp(0, W - 1)[:, None, :].expand(B, T, kv_len)
    window_ok = torch.gather(local_mask, 2, idx) & in_window[:, None, :]
    return (rel < 0)[:, None, :] | window_ok


def causal_mask(prefix_len: Tensor, T: int, kv_len: int) -> Tensor:
    """Mask for T consecutive tokens appended after each sequence's prefix."""
    tril = torch.ones(T, T, dtype=torch.bool, device=prefix_len.device).tril()
    return build_attn_mask(prefix_len, tril, kv_len)


def window_mask(positions: Tensor, kv_len: int, window: int) -> Tensor:
    """[B, T, kv_len]: the slots a sliding window of `window` lets each new token (at `positions`
    [B, T]) see: its window latest positions, itself included (transformers' sliding mask). Slots
    are positions below the prefix (committed tokens sit at their position), and a tree's own nodes
    are all inside the window of its deepest one while the tree is shallower than the window."""
    slots = torch.arange(kv_len, device=positions.device)
    return slots[None, None, :] > positions[:, :, None] - window


def attn_bias(mask: Tensor, dtype: torch.dtype) -> Tensor:
    """Bool mask [B, T, S] -> additive mask [B, 1, T, S] (0 / -inf), built once per step:
    SDPA would otherwise convert the bool mask in every layer."""
    bias = torch.zeros(mask.shape, dtype=dtype, device=mask.device)
    return bias.masked_fill_(~mask, float("-inf"))[:, None]


def attention(q: Tensor, keys: Tensor, values: Tensor, mask: Tensor, gqa: bool,
              causal: bool = False, window: int = 0, offset: int = 0) -> Tensor:
    """SDPA of q [B, heads, T, D] over keys/values [B, kv_heads, S, D] with mask [B, 1, T, S]
    (bool, or additive in q's dtype). `causal`: the mask is the causal mask of slots 0..T-1 (a
    prefill from the start, which wrote those slots; right padding is past every real row), or
    with `offset` of slots offset..offset+T-1 past the offset slots every row holds (a chunk of a
    prompt, or the rest of one past a prefix hit): on a
    CPU, a causal kernel over those slots, which skips the blocks above the diagonal and the
    slots past them that the mask covers: kernels/avx2_attention's causal_attention while the kernel
    is enabled (a 1,089-token prefill's attention, 30 layers, bf16, 2-core AMD EPYC Zen 4: 0.30 s
    against SDPA's causal kernel's 0.47-0.54 s), else SDPA's (1.27 s -> 0.6 s against the mask
    over kv_len on a Zen 2); not on CUDA, where SDPA takes enable_gqa in its flash kernel alone (no
    fp32) and the math kernel it would fall to copies the keys and values per query head
    (grouped_query_attention): not measured there. One bf16 query per row on a CPU runs in fp32:
    torch's CPU flash kernel takes ~4x longer for one bf16 query than for two (AMD EPYC
    AVX512-BF16, 2 threads, S=1024: 570 us at T=1, 178 at T=2, 129 upcast; batch 4: 2,307 vs 445),
    and it accumulates in fp32 anyway. Every plain decode step is such a call, 30 times. fp32 and
    bf16 calls of a few rows on a CPU go to kernels/avx2_attention while it is enabled (the loader
    does, with the "avx2" Linears in fp32 and the "avx512_bf16" ones in bf16). `window` (with
    `causal`): each position sees its `window` latest slots (a sliding layer's prefill; the mask
    says so too): the causal kernel skips the others (Gemma 3 270M's shape, 1,000 positions, bf16,
    2-core Zen 4: 23 ms a sliding layer on SDPA with the mask, ~8 here; the prefill 1.03 -> 0.82 s)."""
    if causal and q.device.type == "cpu":
        T = q.shape[2]
        if avx2_attention.causal_applies(q):
            return torch.ops.eagle.causal_attention(q, keys, values, window, offset)
        if not offset and (not window or T <= window):
            return F.scaled_dot_product_attention(q, keys[:, :, :T], values[:, :, :T], is_causal=True,
                                                  enable_gqa=gqa)
    if avx2_attention.applies(q, mask):
        return torch.ops.eagle.avx2_attention(q, keys, values, mask)
    if q.shape[2] == 1 and q.dtype == torch.bfloat16 and q.device.type == "cpu":
        mask = mask if mask.dtype == torch.bool else mask.float()
        return F.scaled_dot_product_attention(q.float(), keys.float(), values.float(), attn_mask=mask,
                                              enable_gqa=gqa).to(q.dtype)
    if gqa and q.device.type == "cuda":
        return grouped_query_attention(q, keys, values, mask)
    return F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, enable_gqa=gqa)


def softcap(x: Tensor, cap: float) -> Tensor:
    """Gemma 2's soft cap: cap * tanh(x / cap), in x's dtype (transformers'), for its attention
    scores, its logits, and the logits its heads are trained on (losses.draft_loss)."""
    return torch.tanh(x / cap) * cap


def softcapped_attention(q: Tensor, keys: Tensor, values: Tensor, bias: Tensor, cap: float) -> Tensor:
    """Gemma 2's attention: scores q.k / sqrt(D) capped to cap * tanh(score / cap), then the
    additive mask bias [B, 1, T, S], softmax in fp32 (transformers' eager attention, the one it
    runs Gemma 2 with: SDPA takes no cap). q [B, heads, T, D], keys/values [B, kv_heads, S, D]."""
    G = q.shape[1] // keys.shape[1]
    keys, values = keys.repeat_interleave(G, 1), values.repeat_interleave(G, 1)
    scores = (q @ keys.transpose(2, 3)) * q.shape[-1] ** -0.5
    scores = softcap(scores, cap) + bias
    return torch.softmax(scores, -1, dtype=torch.float32).to(q.dtype) @ values


def grouped_query_attention(q: Tensor, keys: Tensor, values: Tensor, mask: Tensor) -> Tensor:
    """attention() with the query heads that share a kv head folded into its query rows:
    q [B, heads, T, D] -> [B, kv_heads, G*T, D] (G = heads / kv_heads; head h reads kv head
    h // G), mask [B, 1, T, S] -> [B, 1, G*T, S]. On CUDA, SDPA runs enable_gqa only in its flash
    kernel, which takes no mask and no fp32: with our masks every call fell to the math kernel,
    which first copies the keys and values G times (at a capture's batch of 256 and kv 1024, ~1 GB
    a layer). Folded, the heads match and the memory-efficient kernel takes the call."""
    B, H, T, D = q.shape
    KVH = keys.shape[1]
    G = H // KVH
    # a view, no copy, where T == 1 (a decode step) or the mask broadcasts over T
    folded_mask = mask[:, :, None].expand(B, 1, G, T, mask.shape[-1]).reshape(B, 1, G * T, -1)
    out = F.scaled_dot_product_attention(q.reshape(B, KVH, G * T, D), keys, values, attn_mask=folded_mask)
    return out.reshape(B, H, T, D)


# ---------------------------------------------------------------------------------------
# Modules


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, offset: float = 0.0):
        super().__init__()
        self.eps, self.offset = eps, offset  # offset: Gemma's, which scales by 1 + weight
        self.weight = nn.Parameter(torch.ones(dim) - offset)

    def forward(self, x: Tensor) -> Tensor:
        # Normalise in fp32, as the HF reference does, so fp32 and bf16 agree with it.
        dtype = x.dtype
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.offset:  # Gemma scales before rounding (transformers' GemmaRMSNorm)
            return (xf * self.offset_scale()).to(dtype)
        return self.weight * xf.to(dtype)

    def offset_scale(self) -> Tensor:
        """What a norm with Gemma's offset scales by: offset + weight, in fp32 (also the fused
        layer op's registered norm: kernels/decoder_layers)."""
        return self.offset + self.weight.float()


# Defined through torch.library.Library rather than @custom_op, whose Python wrapper costs
# ~12 us a call more (30 calls a step).
_LIB = torch.library.Library("eagle_infer", "FRAGMENT")
_LIB.define("kv_write(Tensor(a!) kv, Tensor index, Tensor new) -> ()")


def _kv_write(kv: Tensor, index: Tensor, new: Tensor) -> None:
    """kv viewed as [-1, D], rows `index` [n] = new [n, D], as one opaque in-place op for compiled
    graphs: there, an index_copy_ into a view of the one all-layer cache is functionalized into a
    copy of the whole cache per layer (measured: 65 ms a step for a 24 MB cache), this is not."""
    kv.view(-1, new.shape[-1]).index_copy_(0, index, new)


_LIB.impl("kv_write", _kv_write, "CompositeExplicitAutograd")


@torch.library.register_fake("eagle_infer::kv_write")
def _(kv: Tensor, index: Tensor, new: Tensor) -> None:
    return None


kv_write = torch.ops.eagle_infer.kv_write


SWAP_BYTES = 4 << 20  # KVCache.swap_rows's buffer


class KVCache(nn.Module):
    """Keys and values of every layer in one tensor, kv [layers, 2, batch, kv_heads, S, D].

    A step computes its write indices once (`write_index`) and each layer writes with one
    index_copy_; committing an accepted path (`keep`) and moving or swapping rows (`copy_prefix`,
    `swap_rows`) are a few ops over all layers at once, not a few per layer.
    """

    def __init__(self, layers: int, batch: int, kv_heads: int, max_seq_len: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device | str | None):
        super().__init__()
        shape = (layers, 2, batch, kv_heads, max_seq_len, head_dim)
        self.register_buffer("kv", torch.zeros(shape, dtype=dtype, device=device), persistent=False)
        # base[(l, k|v), row, head] = row index of slot 0 in the cache viewed as [-1, D]; for one
        # layer's writes (kv[l] viewed the same way) the first two entries of dim 0 serve.
        lk = torch.arange(2 * layers, device=device)[:, None, None]
        rows = torch.arange(batch, device=device)[None, :, None]
        heads = torch.arange(kv_heads, device=device)[None, None, :]
        base = ((lk * batch + rows) * kv_heads + heads) * max_seq_len  # [2L, batch, heads]
        self.register_buffer("base", base[..., None], persistent=False)  # [2L, batch, heads, 1]
        # where each row's position 0 sits in the RoPE tables: 0, or LongRoPE's long half
        # (Transformer.start_rows)
        self.register_buffer("rope_row0", torch.zeros(batch, dtype=torch.long, device=device),
                             persistent=False)

    def write_index(self, slots: Tensor, row0: int = 0) -> Tensor:
        """Indices into one layer's cache as [-1, D] of new tokens at slots [B, T] in rows
        row0..: [2 * B * heads * T], ordered (k|v, row, head, token) as `update` lays them out."""
        B = slots.shape[0]
        return (self.base[:2, row0:row0 + B] + slots[None, :, None, :]).reshape(-1)

    def update(self, layer: int, index: Tensor, k: Tensor, v: Tensor, row0: int,
               kv_len: int) -> tuple[Tensor, Tensor]:
        """Write k, v [B, T, kv_heads, D] at `index` (write_index) of one layer; returns that
        layer's keys and values [B, kv_heads, kv_len, D] for rows row0..row0+B-1."""
        cache = self.kv[layer]  # [2, batch, heads, S, D]
        D, B = cache.shape[-1], k.shape[0]
        new = torch.stack([k, v]).transpose(2, 3).reshape(-1, D)  # [2 * B * heads * T, D]
        if torch.compiler.is_compiling():
            kv_write(self.kv, index + layer * cache.numel() // D, new)
        else:
            cache.view(-1, D).index_copy_(0, index, new)  # index_put_ is ~100x slower on CPU
        keys, values = cache.narrow(1, row0, B).narrow(3, 0, kv_len).unbind(0)
        return keys, values

    def keep(self, src: Tensor, dst: Tensor) -> None:
        """Copy entries at slots src [B, K] to slots dst [B, K], per sequence, in every layer."""
        B, D = src.shape[0], self.kv.shape[-1]
        base = self.base[:, :B]  # [2L, B, heads, 1]
        si, di = (base + src[None, :, None, :]).reshape(-1), (base + dst[None, :, None, :]).reshape(-1)
        flat = self.kv.view(-1, D)
        kept = flat.index_select(0, si)  # gathered first: overlap is safe
        if torch.compiler.is_compiling():
            # an opaque in-place write: after the fused layers' cache write, an index_copy_ here
            # made the verify graph end with a copy of the whole cache onto itself (6.6 MB at the
            # bench's 287-slot cache; tests/test_model.py)
            kv_write(self.kv, di, kept)
        else:
            flat.index_copy_(0, di, kept)

    def swap_rows(self, a: int, b: int, n: int) -> None:
        """Exchange the first n slots of two rows (a leaving sequence's row keeps its slots for
        a later prompt that starts the same way: prefix_cache). Three copies through a buffer, a
        few layers (~4 MB) at a time so that it stays in the caches: 0.6 / 3.6 / 6.7 ms at 300 /
        1,000 / 2,048 slots of the default target's bf16 cache, where an index_put of both rows
        (head[:, :, [a, b]] = head[:, :, [b, a]]) took 2.5 / 22 / 44 (scripts/probe_kv_rows.py,
        Zen 4); one buffer for all layers at once took ~20 ms at 2,048 slots (an ad hoc probe)."""
        head = self.kv.narrow(4, 0, n)
        step = max(1, SWAP_BYTES // (head[0, :, a].numel() * head.element_size()))
        for layers in head.split(step):
            row_a = layers[:, :, a].clone()
            layers[:, :, a].copy_(layers[:, :, b])
            layers[:, :, b].copy_(row_a)
        self.rope_row0[[a, b]] = self.rope_row0[[b, a]]

    def copy_prefix(self, src: int, dst: int, n: int) -> None:
        """Copy the first n slots of row src to row dst (a prompt that shares them: prefix_cache)."""
        self.kv[:, :, dst, :, :n].copy_(self.kv[:, :, src, :, :n])
        self.rope_row0[dst] = self.rope_row0[src]


class StepInputs(NamedTuple):
    """What every layer of one forward shares, computed once per step."""

    cache: KVCache
    shape: tuple[int, int]  # (B, T)
    cos: Tensor  # [B, T, 1, D]
    sin: Tensor  # [B, T, 1, D], signed (rope_at)
    bias: Tensor  # [B, 1, T, kv_len] additive mask
    write_index: Tensor  # [2 * B * kv_heads * T] (KVCache.write_index)
    row0: int
    kv_len: int
    causal: bool = False  # bias is the causal mask of slots offset..offset+T-1 (a prefill)
    offset: int = 0  # with causal: the slots every row holds before its T new ones
    local: tuple[Tensor, Tensor, Tensor] | None = None  # the sliding layers' (cos, sin, bias) (Gemma 3)
    window: int = 0  # every layer's window, which bias holds (ModelConfig.window_everywhere)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__()
        self.n_heads, self.n_kv, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.layer = layer  # index into the shared KVCache
        q_out, kv_out = self.n_heads * self.head_dim, self.n_kv * self.head_dim
        # q, k and v in one matmul: fewer kernel launches per layer.
        self.qkv_proj = nn.Linear(cfg.hidden_size, q_out + 2 * kv_out, bias=cfg.attention_bias)
        self.o_proj = nn.Linear(q_out, cfg.hidden_size, bias=False)
        if cfg.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps, cfg.norm_offset)
            self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps, cfg.norm_offset)
        self.qk_norm = cfg.qk_norm
        # attention's own 1/sqrt(D) times this is the config's score scale (Gemma 3's)
        self.query_factor = cfg.query_scale * math.sqrt(self.head_dim) if cfg.query_scale else 1.0
        # its own window's mask and RoPE (Gemma's); where all layers slide alike the step's mask has it
        own_window = layer in cfg.sliding_layers and not cfg.window_everywhere()
        self.sliding = cfg.sliding_window if own_window else 0
        self.softcap = cfg.attn_softcap

    def forward(self, x: Tensor, s: StepInputs) -> Tensor:
        """x [B*T, H] -> [B*T, H]."""
        B, T = s.shape
        nh, nkv = self.n_heads, self.n_kv
        cos, sin, bias, window = s.cos, s.sin, s.bias, s.window
        if self.sliding:
            (cos, sin, bias), window = s.local, self.sliding
        qk, v = self.qkv_proj(x).view(B, T, nh + 2 * nkv, self.head_dim).split([nh + nkv, nkv], 2)
        if self.qk_norm:
            q, k = qk.split([nh, nkv], 2)
            qk = torch.cat([self.q_norm(q), self.k_norm(k)], 2)  # [B, T, nh + nkv, D]
        q, k = rotate(qk, cos, sin).split([nh, nkv], 2)  # q and k rotated together
        if self.query_factor != 1.0:
            q = q * self.query_factor
        keys, values = s.cache.update(self.layer, s.write_index, k, v, s.row0, s.kv_len)
        if self.softcap:
            out = softcapped_attention(q.transpose(1, 2), keys, values, bias, self.softcap)
        else:
            # [B, heads, T, D]
            out = attention(q.transpose(1, 2), keys, values, bias, nkv != nh, s.causal, window, s.offset)
        return self.o_proj(out.transpose(1, 2).reshape(B * T, -1))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.gate_up_proj = nn.Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)
        self.tanh_gelu = cfg.hidden_act == "gelu_pytorch_tanh"

    def forward(self, x: Tensor) -> Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        gate = F.gelu(gate, approximate="tanh") if self.tanh_gelu else F.silu(gate)
        return self.down_proj(gate * up)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__()
        eps, offset = cfg.rms_norm_eps, cfg.norm_offset
        self.input_layernorm = RMSNorm(cfg.hidden_size, eps, offset)
        self.self_attn = Attention(cfg, layer)
        # Llama's norm before the MLP; with sandwich norms (Gemma 3's names) the attention output's
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, eps, offset)
        self.mlp = MLP(cfg)
        self.sandwich = cfg.sandwich_norms
        if self.sandwich:
            self.pre_feedforward_layernorm = RMSNorm(cfg.hidden_size, eps, offset)
            self.post_feedforward_layernorm = RMSNorm(cfg.hidden_size, eps, offset)

    def forward(self, x: Tensor, s: StepInputs) -> Tensor:
        if self.sandwich:
            x = x + self.post_attention_layernorm(self.self_attn(self.input_layernorm(x), s))
            return x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x)))
        x = x + self.self_attn(self.input_layernorm(x), s)
        return x + self.mlp(self.post_attention_layernorm(x))


class Transformer(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.config = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, cfg.norm_offset)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        self.embed_scale = cfg.embed_scale  # rounded to the weights' dtype (_apply), as transformers' Gemma
        self.max_batch = 0
        self.max_seq_len = 0
        self.cache: KVCache | None = None
        self.fused_layers: decoder_layers.Stack | None = None  # decoder_layers.attach
        # generate.compiled_decode's steps by compile mode: kept here so they go with the model
        self.compiled_decode_steps: dict[str | None, object] = {}

    def _apply(self, fn, recurse: bool = True):
        # .to() / .float() / .cuda() make new weights, which a fused stack (holding the old ones)
        # would not see: back to the Python layers (decoder_layers.attach fuses them again)
        self.fused_layers = None
        out = super()._apply(fn, recurse)
        if self.config.embed_scale:
            self.embed_scale = torch.tensor(self.config.embed_scale).to(self.embed_tokens.weight.dtype).item()
        return out

    def setup_cache(self, max_batch: int, max_seq_len: int) -> None:
        """Preallocate the KV cache (and RoPE tables) for up to max_batch x max_seq_len."""
        if max_seq_len > self.config.max_position_embeddings:
            raise UserError(
                f"max_seq_len {max_seq_len} exceeds the model's context "
                f"({self.config.max_position_embeddings})"
            )
        w, c = self.embed_tokens.weight, self.config
        self.cache = None  # free the old one first
        self.cache = KVCache(c.num_layers, max_batch, c.num_kv_heads, max_seq_len, c.head_dim,
                             w.dtype, w.device)
        cos, sin = rope_tables(self.config, max_seq_len)
        self.register_buffer("rope_cos", cos.to(w.device), persistent=False)
        self.register_buffer("rope_sin", sin.to(w.device), persistent=False)
        if c.local_rope_theta:  # Gemma 3's sliding layers: plain RoPE of their own base
            cos, sin = rope_tables(replace(c, rope_theta=c.local_rope_theta, rope_scaling=None), max_seq_len)
            self.register_buffer("local_rope_cos", cos.to(w.device), persistent=False)
            self.register_buffer("local_rope_sin", sin.to(w.device), persistent=False)
        self.max_batch, self.max_seq_len = max_batch, max_seq_len

    def forward(
        self,
        tokens: Tensor,  # [B, T] int64
        positions: Tensor,  # [B, T] RoPE positions
        slots: Tensor,  # [B, T] cache slots to write the new keys/values at
        mask: Tensor,  # [B, T, kv_len] bool, True = attend
        logits_at: Tensor | None = None,  # [B, K] indices into T; None = every token
        hidden_layers: Sequence[int] = (),
        compute_logits: bool = True,
        row0: int = 0,  # batch row b uses cache row row0 + b
        causal: bool = False,  # mask is the causal mask of slots offset..offset+T-1 (a prefill)
        offset: int = 0,  # with causal: the slots every row holds before its T new ones
    ) -> tuple[Tensor | None, list[Tensor]]:
        """Returns logits [B, K, V] (or None) and the hidden states asked for, each [B, T, H]."""
        assert self.cache is not None, "call setup_cache() before forward()"
        B, T = tokens.shape
        x = self.embed_tokens(tokens).view(B * T, -1)  # [B*T, H]: 2-D linears dispatch fewer ops
        if self.embed_scale:
            x = x * self.embed_scale
        c = self.config
        # LongRoPE: each row's half of the tables (start_rows)
        rows = positions + self.cache.rope_row0[row0:row0 + B, None] if c.long_rope_from() else positions
        cos, sin = rope_at(self.rope_cos, self.rope_sin, rows, x.dtype)
        local = None
        every_window = 0
        if c.window_everywhere():  # one window for every layer: in the mask (the fused op reads it)
            mask = mask & window_mask(positions, mask.shape[-1], c.sliding_window)
            every_window = c.sliding_window
        elif c.sliding_layers:  # Gemma's: their own mask, and (Gemma 3) their own RoPE
            window = window_mask(positions, mask.shape[-1], c.sliding_window)
            local_rope = rope_at(self.local_rope_cos, self.local_rope_sin, positions, x.dtype) \
                if c.local_rope_theta else (cos, sin)
            local = (*local_rope, attn_bias(mask & window, x.dtype))
        s = StepInputs(self.cache, (B, T), cos, sin, attn_bias(mask, x.dtype),
                       self.cache.write_index(slots, row0), row0, mask.shape[-1], causal, offset, local,
                       every_window)
        wanted = sorted(set(hidden_layers) - {len(self.layers)})
        taps: dict[int, Tensor]
        if decoder_layers.applies(self, B, T):  # the layers as one C++ call (kernels/decoder_layers)
            out = torch.ops.eagle.decoder_layers(self.fused_layers.handle, x, cos, sin, s.bias,
                                                 *(local or (cos, sin, s.bias)), s.write_index,
                                                 self.cache.kv, row0, B, wanted)  # [1 + taps, B*T, H]
            x, taps = out[0], dict(zip(wanted, out[1:]))
        else:
            taps = {}
            for i, layer in enumerate(self.layers):
                if i in wanted:
                    taps[i] = x
                x = layer(x, s)
        x = self.norm(x)
        taps[len(self.layers)] = x
        hidden = [taps[i].view(B, T, -1) for i in hidden_layers]
        if not compute_logits:
            return None, hidden
        x = x.view(B, T, -1)
        if logits_at is not None:
            x = torch.gather(x, 1, logits_at[..., None].expand(-1, -1, x.shape[-1]))
        return self.logits(x), hidden

    def logits(self, x: Tensor) -> Tensor:
        """The logits of final normed states x [..., H]: lm_head, soft-capped where the config says
        (Gemma 2's cap * tanh(logit / cap), in the logits' dtype as transformers computes it)."""
        logits = self.lm_head(x)
        cap = self.config.final_softcap
        return softcap(logits, cap) if cap else logits

    @torch.no_grad()
    def start_rows(self, row0: int, max_lens: Tensor) -> None:
        """New sequences begin in cache rows row0.., each at most max_lens [B] tokens long (prompt
        + max new tokens). A LongRoPE target turns a sequence that may pass its original context
        with the long factors throughout, else with the short ones: per sequence, so its cache
        never mixes the two, a verify's tokens turn as the plain steps' would, and a batch cannot
        change another sequence's. transformers decides by the longest position of each call (a
        prompt past the original context: long throughout, as here; a sequence that decoding
        carries past it: short until then, when Phi-3's generate recomputes the whole cache with
        the long ones); vLLM by its max_model_len, for every sequence."""
        if self.config.long_rope_from():
            self.cache.rope_row0[row0:row0 + len(max_lens)] = self.rope_row0_for(max_lens).to(
                self.cache.rope_row0.device)

    def rope_row0_for(self, max_lens: Tensor) -> Tensor:
        """KVCache.rope_row0 of sequences at most max_lens [B] tokens long (start_rows)."""
        original = self.config.long_rope_from()
        return (max_lens > original).long() * self.max_seq_len if original else torch.zeros_like(max_lens)

    @torch.no_grad()
    def keep_slots(self, src: Tensor, dst_start: Tensor) -> None:
        """Move cache entries at slots src [B, K] to dst_start[b] + 0..K-1, per sequence.

        Used after verification to keep the accepted path only. Pad a shorter path by
        repeating its last slot: the extra copies land beyond the new length, where the mask
        never looks.
        """
        dst = dst_start[:, None] + torch.arange(src.shape[1], device=src.device)[None, :]
        self.cache.keep(src, dst)


# ---------------------------------------------------------------------------------------
# Hugging Face checkpoint names -> ours (q/k/v and gate/up are fused at load time).


# a multimodal checkpoint's language model (Gemma 3 4B and up: the Hub's layout, then transformers 5's)
LANGUAGE_MODEL_PREFIXES = ("language_model.model.", "model.language_model.", "language_model.")
OTHER_TOWERS = ("vision_tower.", "multi_modal_projector.", "model.vision_tower.",
                "model.multi_modal_projector.")


def module_name(name: str) -> str | None:
    """A checkpoint tensor's name under our Transformer before the q/k/v and gate/up fusion
    (the language model's prefix off: "model.norm.weight" -> "norm.weight"), None for another
    tower's (a multimodal checkpoint's vision tower and projector)."""
    if name.startswith(OTHER_TOWERS):
        return None
    prefix = next((p for p in (*LANGUAGE_MODEL_PREFIXES, "model.") if name.startswith(p)), "")
    return name[len(prefix):]


def convert_hf_state_dict(sd: dict[str, Tensor], cfg: ModelConfig) -> dict[str, Tensor]:
    out: dict[str, Tensor] = {}
    for name, t in sd.items():
        if (ours := module_name(name)) is not None:
            out[ours] = t
    for i in range(cfg.num_layers):
        p = f"layers.{i}."
        for kind in ("weight", "bias"):
            qkv = [p + f"self_attn.{x}_proj.{kind}" for x in "qkv"]
            if all(k in out for k in qkv):
                out[p + f"self_attn.qkv_proj.{kind}"] = torch.cat([out.pop(k) for k in qkv])
        gu = [p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight"]
        if all(k in out for k in gu):
            out[p + "mlp.gate_up_proj.weight"] = torch.cat([out.pop(k) for k in gu])
        if cfg.rotary_dim < cfg.head_dim:  # partial rotary: the turned dims where rope_tables turns them
            order = rotary_order(cfg)
            heads = torch.arange(cfg.num_heads + cfg.num_kv_heads)[:, None] * cfg.head_dim
            rows = torch.cat([(heads + order).reshape(-1), torch.arange(heads.numel() * cfg.head_dim,
                              (cfg.num_heads + 2 * cfg.num_kv_heads) * cfg.head_dim)])  # v rows stay
            for kind in ("weight", "bias"):
                if (name := p + f"self_attn.qkv_proj.{kind}") in out:
                    out[name] = out[name][rows]
            for name in (p + "self_attn.q_norm.weight", p + "self_attn.k_norm.weight"):
                if name in out:
                    out[name] = out[name][order]
    if cfg.tie_word_embeddings:
        out.pop("lm_head.weight", None)
    # Some checkpoints ship rotary caches; we compute our own.
    return {k: v for k, v in out.items() if "rotary_emb" not in k}
