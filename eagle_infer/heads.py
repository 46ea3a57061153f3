"""EAGLE-2 and EAGLE-3 draft heads, and their checkpoint format: the one module that training
and serving both import.

EAGLE-2 (same head as EAGLE-1):
    x = fc(cat(embed(token_{t+1}), f_t))            # 2h -> h; f = target's final (normed) state
    g = DecoderLayer(x)  (no input layernorm)       # predicted next feature f_{t+1}
    logits = target_lm_head(g)                       # optionally restricted by an FR-Spec map
EAGLE-3:
    h = fc(cat(a_low, a_mid, a_high))                # 3h -> h, from the target's aux states
        or the head's own previous output g          # when unrolled on its own outputs
    x = cat(input_layernorm(embed(token)), hidden_norm(h))         # 2h: attention input
    g = h + attn(x); g = g + mlp(post_attention_layernorm(g))      # next-step input
    logits = lm_head(norm(g))  over the draft vocabulary; target id = id + d2t[id]

Both heads share one calling convention, so drafting code never branches on the kind:
    head.target_layers(n)  -> HF hidden-state indices the head reads from the target
    head.project(states)   -> the head's input feature [B, T, h] from those states
    head(tokens, feature, positions, mask, slots=None, past_kv=())
                           -> (logits [B, T, V_draft], g [B, T, h], (k, v))
    head.draft_to_target   -> [V_draft] target ids of the logits' columns, or None (identity)

Checkpoints are written in the official layouts (reference.md section 4), which SGLang and vLLM
load; load_head also reads the other published forms (yuhuili's EAGLE-1/2/3, SpecForge, vLLM
speculators; safetensors or .bin, sharded or not): see head_formats.py.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from eagle_infer.errors import UserError
from eagle_infer.head_formats import (
    EAGLE2_ARCH,
    EAGLE3_ARCH,
    canonical_state_dict,
    is_speculators,
    read_weights,
    speculators_to_flat,
    write_head_folder,
)
from eagle_infer.model import KVCache, ModelConfig, RMSNorm, apply_rope, attention, attn_bias, rope_tables
from eagle_infer.quantize import lm_head_weight, quantize_linears


def aux_layer_ids_of(cfg: dict[str, Any]) -> list[int]:
    """EAGLE-3 aux layer ids in SGLang's convention (id i = output of layer i): from
    `eagle_config`, else from vLLM's top-level key (id k = state after k layers, so k - 1)."""
    ids = (cfg.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
    if ids:
        return [int(i) for i in ids]
    return [int(k) - 1 for k in cfg.get("eagle_aux_hidden_state_layer_ids") or []]


@dataclass
class HeadConfig:
    kind: str  # "eagle2" | "eagle3"
    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int  # the target's vocabulary
    draft_vocab_size: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    max_position_embeddings: int = 4096
    # EAGLE-2 only. Off by default: vLLM builds fc without a bias and reads config "bias" as the
    # attention bias, so a head with fc.bias loads there with empty q/k/v/o biases and accepts
    # nothing; SGLang builds fc with bias=config.bias. Official EAGLE-1 heads (bias true) still load.
    fc_bias: bool = False
    # Official convention: the *output* index of the target layers (hidden index - 1).
    aux_layer_ids: list[int] = field(default_factory=list)
    # EAGLE-3 only: the residual is hidden_norm(h) instead of h (vLLM speculators' variant; SGLang
    # and EAGLE's own heads add the un-normed h).
    norm_before_residual: bool = False

    @classmethod
    def for_target(cls, target: ModelConfig, kind: str, draft_vocab_size: int | None = None,
                   aux_hidden_indices: Sequence[int] | None = None, fc_bias: bool = False) -> HeadConfig:
        """A head sized for `target` (the shapes the target's features dictate)."""
        if kind not in ("eagle2", "eagle3"):
            raise UserError(f"unknown draft kind '{kind}': use eagle2 or eagle3")
        idx = list(aux_hidden_indices or target.eagle3_layer_ids()) if kind == "eagle3" else []
        return cls(
            kind=kind, hidden_size=target.hidden_size, intermediate_size=target.intermediate_size,
            num_heads=target.num_heads, num_kv_heads=target.num_kv_heads, head_dim=target.head_dim,
            vocab_size=target.vocab_size,
            draft_vocab_size=(draft_vocab_size or target.vocab_size) if kind == "eagle3"
            else target.vocab_size,
            rms_norm_eps=target.rms_norm_eps, rope_theta=target.rope_theta,
            # a Llama layer's rope: LongRoPE's factors are sized for the target's (partial) rotary
            # dims, and a draft layer of a few positions gains nothing from them: plain RoPE there
            rope_scaling=None if (target.rope_scaling or {}).get("rope_type") == "longrope"
            else target.rope_scaling,
            # the target's context: vLLM sizes the draft's rotary cache from it (before 0.32, which
            # raises it to the target's, a gather out of bounds past it: vLLM #48894)
            max_position_embeddings=target.max_position_embeddings,
            fc_bias=fc_bias, aux_layer_ids=[i - 1 for i in idx],
        )

    @property
    def aux_hidden_indices(self) -> list[int]:
        return [i + 1 for i in self.aux_layer_ids]

    def rope_config(self) -> ModelConfig:
        return ModelConfig(model_type="llama", vocab_size=self.vocab_size, hidden_size=self.hidden_size,
                           intermediate_size=self.intermediate_size, num_layers=1,
                           num_heads=self.num_heads, num_kv_heads=self.num_kv_heads,
                           head_dim=self.head_dim, rope_theta=self.rope_theta,
                           rope_scaling=self.rope_scaling,
                           max_position_embeddings=self.max_position_embeddings)

    def to_hf(self) -> dict[str, Any]:
        """config.json in the official layout."""
        cfg: dict[str, Any] = {
            "model_type": "llama",
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "num_hidden_layers": 1,
            "vocab_size": self.vocab_size,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "rope_scaling": self.rope_scaling,
            "max_position_embeddings": self.max_position_embeddings,
            "hidden_act": "silu",
            "tie_word_embeddings": False,
        }
        if self.kind == "eagle3":
            cfg.update({
                "architectures": [EAGLE3_ARCH],
                "draft_vocab_size": self.draft_vocab_size,
                "target_hidden_size": self.hidden_size,
                "eagle_config": {"eagle_aux_hidden_state_layer_ids": self.aux_layer_ids,
                                 "use_aux_hidden_state": True},
                # vLLM reads this key first and takes id k as the state after k layers; SGLang reads
                # eagle_config (id i = output of layer i). Both then capture the trained layers.
                "eagle_aux_hidden_state_layer_ids": self.aux_hidden_indices,
            })
            if self.norm_before_residual:  # vLLM reads it from the top level of an EAGLE-3 config
                cfg["norm_before_residual"] = True
        else:
            cfg.update({"architectures": [EAGLE2_ARCH], "bias": self.fc_bias})
        return cfg

    @classmethod
    def from_hf(cls, cfg: dict[str, Any], state_keys: Sequence[str] | None = None) -> HeadConfig:
        """Any published head config (official EAGLE-1/2/3, SpecForge, vLLM speculators); pass the
        checkpoint's keys where known (they settle the kind and the fc bias)."""
        if is_speculators(cfg):
            cfg = speculators_to_flat(cfg)
        arch = (cfg.get("architectures") or [""])[0]
        keys = set(state_keys or ())
        is3 = (arch == EAGLE3_ARCH or "draft_vocab_size" in cfg
               or any(k.removeprefix("model.").startswith("midlayer.") for k in keys))
        layers = cfg.get("num_hidden_layers", 1)
        if layers != 1:
            raise UserError(f"{layers} decoder layers; this runtime runs one-layer EAGLE heads")
        n_heads = cfg["num_attention_heads"]
        target_h = cfg.get("target_hidden_size")
        if is3 and target_h is not None and target_h != cfg["hidden_size"]:
            raise UserError(f"target_hidden_size {target_h} != the head's hidden size {cfg['hidden_size']}: "
                            f"heads narrower than their target are not supported")
        rope = dict(cfg.get("rope_parameters") or {})
        scaling = cfg.get("rope_scaling") or None
        if rope and rope.get("rope_type", "default") != "default":  # transformers >= 5 spelling
            scaling = rope
        # The fc bias is what the checkpoint holds; only without its keys does config "bias" decide.
        fc_bias = ("fc.bias" in keys or "model.fc.bias" in keys) if keys else bool(cfg.get("bias", False))
        return cls(
            kind="eagle3" if is3 else "eagle2",
            hidden_size=cfg["hidden_size"], intermediate_size=cfg["intermediate_size"],
            num_heads=n_heads, num_kv_heads=cfg.get("num_key_value_heads") or n_heads,
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // n_heads,
            vocab_size=cfg["vocab_size"],
            draft_vocab_size=cfg.get("draft_vocab_size") or cfg["vocab_size"],
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-5),
            rope_theta=float(rope.get("rope_theta", cfg.get("rope_theta", 10000.0))),
            rope_scaling=scaling,
            max_position_embeddings=cfg.get("max_position_embeddings", 4096),
            fc_bias=fc_bias and not is3,
            aux_layer_ids=aux_layer_ids_of(cfg),
            norm_before_residual=bool(cfg.get("norm_before_residual", False)) and is3,
        )


@dataclass
class UnrolledMask:
    """Keys of an unrolled training step (training-time test): step 0's keys (``past_kv[0]``)
    under ``causal`` [B, T, T0]; each later step's keys (``past_kv[1:]`` and this call's) only at
    the query's own index. That is all a chain draft sees; passing the structure instead of a
    dense [B, T, T0 + s*T] mask skips scoring s*T keys per query that would all be masked."""

    causal: Tensor


def unrolled_attention(q: Tensor, past_kv: Sequence[tuple[Tensor, Tensor]], k: Tensor, v: Tensor,
                       causal: Tensor) -> Tensor:
    """Attention of an unrolled step: q [B, nh, T, d]; past_kv[0] [B, T0, nkv, d] each; the later
    steps' and this call's k, v [B, T, nkv, d]. Returns [B, nh, T, d] (see UnrolledMask)."""
    B, nh, T, d = q.shape
    k0, v0 = (x.permute(0, 2, 1, 3)[:, :, None] for x in past_kv[0])  # [B, nkv, 1, T0, d]
    nkv = k0.shape[1]
    qg = q.view(B, nkv, nh // nkv, T, d) * d ** -0.5  # query head i reads kv head i // group
    kd = torch.stack([pk for pk, _ in past_kv[1:]] + [k], 3).transpose(1, 2)  # [B, nkv, T, s, d]
    vd = torch.stack([pv for _, pv in past_kv[1:]] + [v], 3).transpose(1, 2)
    scores0 = (qg @ k0.transpose(-1, -2)).masked_fill(~causal[:, None, None], float("-inf"))
    scores_d = torch.einsum("bkgtd,bktsd->bkgts", qg, kd)
    w = torch.softmax(torch.cat([scores0, scores_d], -1), -1)
    T0 = scores0.shape[-1]
    out = w[..., :T0] @ v0 + torch.einsum("bkgts,bktsd->bkgtd", w[..., T0:], vd)
    return out.reshape(B, nh, T, d)


class DraftAttention(nn.Module):
    def __init__(self, cfg: HeadConfig, in_dim: int):
        super().__init__()
        self.n_heads, self.n_kv, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.q_proj = nn.Linear(in_dim, self.n_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(in_dim, self.n_kv * self.head_dim, bias=False)
        self.v_proj = nn.Linear(in_dim, self.n_kv * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.n_heads * self.head_dim, cfg.hidden_size, bias=False)
        self.cache: KVCache | None = None

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, mask: Tensor | UnrolledMask,
                slots: Tensor | None, past_kv: Sequence[tuple[Tensor, Tensor]],
                row0: int = 0) -> tuple[Tensor, tuple[Tensor, Tensor]]:
        """Serving: the static cache (written at `slots`); training: this call's keys after
        `past_kv` (earlier unrolled steps), with `mask` [B, T, S] covering all of them or an
        UnrolledMask."""
        B, T, _ = x.shape
        q = apply_rope(self.q_proj(x).view(B, T, self.n_heads, self.head_dim), cos, sin)
        k = apply_rope(self.k_proj(x).view(B, T, self.n_kv, self.head_dim), cos, sin)
        v = self.v_proj(x).view(B, T, self.n_kv, self.head_dim)
        if isinstance(mask, UnrolledMask):
            out = unrolled_attention(q.transpose(1, 2), past_kv, k, v, mask.causal)
            return self.o_proj(out.transpose(1, 2).reshape(B, T, -1)), (k, v)
        if self.cache is not None and slots is not None:  # serving: layer 0 of a one-layer KVCache
            keys, values = self.cache.update(0, self.cache.write_index(slots, row0), k, v, row0,
                                             mask.shape[-1])
            # as the target's layers: an additive bias, which the CPU attention kernel takes (a
            # bool mask went to SDPA: MKL bf16 GEMMs in every draft step and catch-up, Zen 4)
            mask = attn_bias(mask, q.dtype)
        else:
            keys = torch.cat([pk for pk, _ in past_kv] + [k], dim=1).transpose(1, 2)
            values = torch.cat([pv for _, pv in past_kv] + [v], dim=1).transpose(1, 2)
            mask = mask[:, None]
        out = attention(q.transpose(1, 2), keys, values, mask, self.n_kv != self.n_heads)
        return self.o_proj(out.transpose(1, 2).reshape(B, T, -1)), (k, v)


class DraftMLP(nn.Module):
    def __init__(self, cfg: HeadConfig):
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DraftLayer(nn.Module):
    """The head's single decoder layer. EAGLE-3 adds input_layernorm/hidden_norm and a 2h-wide
    attention input; EAGLE-2 has no input layernorm at all."""

    def __init__(self, cfg: HeadConfig):
        super().__init__()
        h = cfg.hidden_size
        self.eagle3 = cfg.kind == "eagle3"
        self.norm_before_residual = self.eagle3 and cfg.norm_before_residual
        if self.eagle3:
            self.input_layernorm = RMSNorm(h, cfg.rms_norm_eps)
            self.hidden_norm = RMSNorm(h, cfg.rms_norm_eps)
        self.self_attn = DraftAttention(cfg, 2 * h if self.eagle3 else h)
        self.post_attention_layernorm = RMSNorm(h, cfg.rms_norm_eps)
        self.mlp = DraftMLP(cfg)

    def forward(self, emb: Tensor, h: Tensor, cos: Tensor, sin: Tensor, mask: Tensor,
                slots: Tensor | None, past_kv, row0: int = 0) -> tuple[Tensor, tuple[Tensor, Tensor]]:
        if self.eagle3:
            hn = self.hidden_norm(h)
            x = torch.cat([self.input_layernorm(emb), hn], -1)
            if self.norm_before_residual:
                h = hn
        else:
            x = h
        a, kv = self.self_attn(x, cos, sin, mask, slots, past_kv, row0)
        g = h + a
        return g + self.mlp(self.post_attention_layernorm(g)), kv


class DraftHead(nn.Module):
    """An EAGLE-2 or EAGLE-3 draft head bound to its target's embedding (and, for EAGLE-2, its
    lm_head). Only the head's own weights are trained and saved."""

    def __init__(self, cfg: HeadConfig, embed_tokens: nn.Embedding, target_lm_head: Tensor | None = None):
        super().__init__()
        self.config = cfg
        h = cfg.hidden_size
        self.eagle3 = cfg.kind == "eagle3"
        # The target's embedding is frozen and shared, never part of the head's checkpoint.
        self.embed_tokens = [embed_tokens]
        if self.eagle3:
            self.fc = nn.Linear(3 * h, h, bias=False)
            self.midlayer = DraftLayer(cfg)
            self.norm = RMSNorm(h, cfg.rms_norm_eps)
            self.lm_head = nn.Linear(h, cfg.draft_vocab_size, bias=False)
            self.register_buffer("d2t", torch.zeros(cfg.draft_vocab_size, dtype=torch.long))
            self.register_buffer("t2d", torch.ones(cfg.vocab_size, dtype=torch.bool))
            # Training only (draft.fc_input_scale): fc reads its input times this [3h] scale, and
            # the checkpoint holds the weight with the scale folded in (head_state_dict), so a
            # saved head is the plain architecture every engine loads.
            self.register_buffer("fc_input_scale", None, persistent=False)
        else:
            self.fc = nn.Linear(2 * h, h, bias=cfg.fc_bias)
            self.layers = nn.ModuleList([DraftLayer(cfg)])
            if target_lm_head is None:
                raise UserError("an EAGLE-2 head needs the target's lm_head")
            self.target_lm_head = [target_lm_head]
            # Serving computes full-vocabulary draft logits with the target's lm_head module itself
            # (load_head_for), on the target's CPU backend: F.linear on the fp32 weight ran MKL's
            # sgemm, 26 ms for 4 rows x 49,152 (AMD EPYC AVX2), 3x what streaming the weight costs.
            self.target_lm_head_module: list[nn.Module] = []
        # FR-Spec: rows of the lm_head kept for drafting, and their target ids.
        self.register_buffer("token_map", None, persistent=False)
        self.register_buffer("draft_lm_head", None, persistent=False)
        self.max_batch = 0
        self.max_seq_len = 0
        self._rope = None

    # -- shared calling convention --------------------------------------------------------

    @property
    def layer(self) -> DraftLayer:
        return self.midlayer if self.eagle3 else self.layers[0]

    @property
    def weight_like(self) -> Tensor:
        """A float weight of the head: its dtype and device are the head's (an int8 head's
        Linears hold int8 weights but compute in this dtype)."""
        return self.layer.post_attention_layernorm.weight

    def target_layers(self, num_target_layers: int) -> list[int]:
        """HF hidden-state indices this head reads from the target."""
        return self.config.aux_hidden_indices if self.eagle3 else [num_target_layers]

    def project(self, target_states: Sequence[Tensor]) -> Tensor:
        """Target states (as listed by target_layers) -> the head's input feature [B, T, h]."""
        if self.eagle3:
            x = torch.cat(list(target_states), dim=-1)
            if self.fc_input_scale is not None:
                x = x * self.fc_input_scale
            return self.fc(x)
        return target_states[0]

    @property
    def draft_to_target(self) -> Tensor | None:
        """Target ids of the logits' columns ([V_draft]); None when they are the target's."""
        if self.token_map is not None:
            return self.token_map
        if self.eagle3:
            return torch.arange(self.config.draft_vocab_size, device=self.d2t.device) + self.d2t
        return None

    def set_token_map(self, ids: Tensor | None) -> None:
        """FR-Spec for EAGLE-2: draft over these target ids only (lm_head rows copied once: a
        static map beats re-gathering rows every step)."""
        if self.eagle3 and ids is not None:
            raise UserError("an EAGLE-3 head drafts over its own vocabulary (d2t); "
                            "token maps are for EAGLE-2 heads")
        if ids is None:
            self.token_map, self.draft_lm_head = None, None
            return
        w = self.target_lm_head[0]
        self.token_map = ids.to(w.device, torch.long)
        self.draft_lm_head = w[self.token_map].contiguous()

    def logits(self, g: Tensor) -> Tensor:
        if self.eagle3:
            return self.lm_head(self.norm(g))
        if self.draft_lm_head is not None:
            return F.linear(g, self.draft_lm_head)
        if self.target_lm_head_module:
            return self.target_lm_head_module[0](g)
        return F.linear(g, self.target_lm_head[0])

    def setup_cache(self, max_batch: int, max_seq_len: int) -> None:
        w = self.weight_like
        c = self.config
        self.layer.self_attn.cache = None  # free the old one first
        self.layer.self_attn.cache = KVCache(1, max_batch, c.num_kv_heads, max_seq_len, c.head_dim,
                                             w.dtype, w.device)
        self.max_batch, self.max_seq_len = max_batch, max_seq_len
        self._rope = None
        self.rope(torch.zeros(1, dtype=torch.long, device=w.device))

    def rope(self, positions: Tensor) -> tuple[Tensor, Tensor]:
        # Tables cover the whole context once, so serving never syncs on positions.max().
        if self._rope is None or self._rope[0].device != positions.device:
            n = max(self.max_seq_len, self.config.max_position_embeddings)
            cos, sin = rope_tables(self.config.rope_config(), n)
            self._rope = (cos.to(positions.device), sin.to(positions.device))
        return self._rope[0][positions], self._rope[1][positions]

    def forward(
        self,
        tokens: Tensor,  # [B, T] token t+1 paired with feature t
        feature: Tensor,  # [B, T, h] from project() or the head's own previous output
        positions: Tensor,  # [B, T]
        mask: Tensor | UnrolledMask,  # [B, T, S] bool over the keys (cache slots, or past_kv + this call)
        slots: Tensor | None = None,  # [B, T] cache slots (serving); None = no cache (training)
        past_kv: Sequence[tuple[Tensor, Tensor]] = (),
        compute_logits: bool = True,
        row0: int = 0,  # serving: batch row b uses cache row row0 + b
    ) -> tuple[Tensor | None, Tensor, tuple[Tensor, Tensor]]:
        emb = self.embed_tokens[0](tokens).to(feature.dtype)
        cos, sin = self.rope(positions)
        if self.eagle3:
            g, kv = self.midlayer(emb, feature, cos, sin, mask, slots, past_kv, row0)
        else:
            x = self.fc(torch.cat([emb, feature], dim=-1))
            g, kv = self.layers[0](emb, x, cos, sin, mask, slots, past_kv, row0)
        return (self.logits(g) if compute_logits else None), g, kv

    @property
    def cache(self) -> KVCache:
        """The head's KV cache (one layer), rows as the target's (setup_cache)."""
        return self.layer.self_attn.cache

    # -- checkpoint ------------------------------------------------------------------------

    def head_state_dict(self) -> dict[str, Tensor]:
        """The head's own weights under the official key names."""
        sd = {k: v for k, v in self.state_dict().items() if k not in ("token_map", "draft_lm_head")}
        if self.eagle3:
            sd["d2t"], sd["t2d"] = self.d2t, self.t2d
            if self.fc_input_scale is not None:  # fc(x * s) = (W diag(s)) x
                w = sd["fc.weight"]
                sd["fc.weight"] = (w.float() * self.fc_input_scale.float()).to(w.dtype)
        return sd


def check_head_against_target(cfg: HeadConfig, target: ModelConfig, where: str) -> None:
    """Refuse a head built for another target, naming the mismatch."""
    problems = []
    if cfg.hidden_size != target.hidden_size:
        problems.append(f"hidden size {cfg.hidden_size} != target's {target.hidden_size}")
    if cfg.vocab_size != target.vocab_size:
        problems.append(f"vocabulary {cfg.vocab_size} != target's {target.vocab_size}")
    for i in cfg.aux_hidden_indices:
        if not 0 <= i <= target.num_layers:
            problems.append(f"aux layer {i - 1} outside the target's {target.num_layers} layers")
    if problems:
        raise UserError(f"draft head {where} does not fit the target model: " + "; ".join(problems))


def save_head(head: DraftHead, out_dir: str | os.PathLike, extra: dict[str, Any] | None = None,
              dtype: torch.dtype = torch.bfloat16) -> Path:
    """Write config.json + model.safetensors in the official layout (atomically); bf16 by
    default, as published heads are."""
    cfg = head.config.to_hf() | {"torch_dtype": str(dtype).removeprefix("torch.")} | (extra or {})
    return write_head_folder(out_dir, cfg, head.head_state_dict(), dtype)


def read_head(path: str | os.PathLike) -> tuple[HeadConfig, dict[str, Tensor]]:
    """A head folder in any published layout: its HeadConfig and its weights under our key names
    (EAGLE-3 without d2t/t2d gets the identity map). No target needed (export uses it)."""
    folder = Path(path)
    if not (folder / "config.json").is_file():
        raise UserError(f"draft head not found: {folder} has no config.json")
    raw = read_weights(folder)
    try:
        cfg = HeadConfig.from_hf(json.loads((folder / "config.json").read_text()), raw.keys())
    except KeyError as e:
        raise UserError(f"draft head {folder}: config.json lacks {e}") from None
    except UserError as e:
        raise UserError(f"draft head {folder}: {e}") from None
    sd = canonical_state_dict(raw, cfg.kind)
    if cfg.kind == "eagle3":
        if "d2t" not in sd:  # a full-vocabulary EAGLE-3 head
            sd["d2t"] = torch.zeros(cfg.draft_vocab_size, dtype=torch.long)
            sd["t2d"] = torch.ones(cfg.vocab_size, dtype=torch.bool)
        sd["d2t"], sd["t2d"] = sd["d2t"].long(), sd["t2d"].bool()
    return cfg, sd


def _check_layout(head: DraftHead, sd: dict[str, Tensor], where: str) -> None:
    """Refuse weights that do not fill this head exactly, naming the tensors (before load_state_dict,
    whose shape errors are tracebacks)."""
    want = {k: v.shape for k, v in head.state_dict().items() if k not in ("token_map", "draft_lm_head")}
    missing = sorted(set(want) - set(sd))
    unexpected = sorted(set(sd) - set(want))
    if missing or unexpected:
        raise UserError(f"draft head {where} does not match the {head.config.kind} layout: "
                        f"missing {missing[:6]}, unexpected {unexpected[:6]}")
    wrong = [f"{k} {tuple(sd[k].shape)} (expected {tuple(s)})" for k, s in want.items() if sd[k].shape != s]
    if wrong:
        raise UserError(f"draft head {where}: tensors of the wrong shape: " + "; ".join(wrong[:4]))


def load_head(path: str | os.PathLike, target_cfg: ModelConfig, embed_tokens: nn.Embedding,
              target_lm_head: Tensor | None = None, dtype: torch.dtype | None = None) -> DraftHead:
    """Load our own or a published EAGLE-2 / EAGLE-3 checkpoint (any layout read_head reads);
    refuse one for another target, naming the mismatch."""
    folder = Path(path)
    cfg, sd = read_head(folder)
    if cfg.kind == "eagle3" and not cfg.aux_layer_ids:
        cfg.aux_layer_ids = [i - 1 for i in target_cfg.eagle3_layer_ids()]
    check_head_against_target(cfg, target_cfg, str(folder))
    if cfg.kind == "eagle3" and sd["t2d"].shape[0] != target_cfg.vocab_size:
        raise UserError(f"draft head {folder}: t2d covers {sd['t2d'].shape[0]} tokens but the target "
                        f"vocabulary has {target_cfg.vocab_size}")
    rows = sd["lm_head.weight"].shape[0] if "lm_head.weight" in sd else cfg.draft_vocab_size
    if cfg.kind == "eagle3" and rows != cfg.draft_vocab_size:
        raise UserError(f"draft head {folder}: lm_head has {sd['lm_head.weight'].shape[0]} rows but "
                        f"draft_vocab_size is {cfg.draft_vocab_size}")
    head = DraftHead(cfg, embed_tokens, target_lm_head)
    _check_layout(head, sd, str(folder))
    head.load_state_dict(sd, strict=True)
    w = embed_tokens.weight
    head = head.to(device=w.device, dtype=dtype or w.dtype)
    if cfg.kind == "eagle3":
        head.d2t, head.t2d = head.d2t.long(), head.t2d.bool()
    return head.eval().requires_grad_(False)


def load_head_for(path: str | os.PathLike, target) -> DraftHead:
    """load_head with the embedding / lm_head taken from our target Transformer, its Linears on
    the target's CPU backend (load_model's cpu_linears): a draft step runs eagle_topk rows.
    An int8 target gets an int8 head: a draft step, like a target step, streams its weights."""
    head = load_head(path, target.config, target.embed_tokens, lm_head_weight(target))
    if not head.eagle3:
        head.target_lm_head_module = [target.lm_head]
    quantization = getattr(target, "quantization", "none")
    if quantization != "none":
        quantize_linears(head, quantization, getattr(target, "cpu_linears", "torch"))
    else:
        from eagle_infer.cpu_linears import use_backend_linears

        use_backend_linears(head, getattr(target, "cpu_linears", "torch"))
    return head
