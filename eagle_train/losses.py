"""Training-time test: unrolling a draft head on its own outputs, and the EAGLE-2 / EAGLE-3 losses.

Index convention (shared by training and evaluation, and the one drafting uses). A captured
sequence has tokens x_0..x_{T-1} and the target's final states f_0..f_{T-1}; the target's
distribution at position p, softmax(lm_head(f_p)), is the distribution of x_{p+1}.

    pair t, step 0:  feature = project(target states at t), token x_{t+1}, RoPE position t
    pair t, step s:  feature = the head's own g at (t, s-1),  token x_{t+1+s}, position t+s
    output (t, s):   g ~ f_{t+1+s}; logits ~ the target's distribution at position t+1+s,
                     i.e. of token x_{t+2+s}

At step s the query at t attends to the step-0 keys at positions <= t (causal) and to the
keys of steps 1..s at the same t (diagonal): keys = cat(K_0, ..., K_s), mask = [tril | I | I ..]
(handed to the head as an UnrolledMask, so the identity blocks cost one score per step, not T).
That is exactly what a chain draft sees at serving time: the verified prefix, then its own
earlier drafts of the same branch.

A prediction (t, s) counts when the token it predicts, x_{t+2+s}, lies in the sequence and
is an assistant token (loss_mask). Right padding needs no attention mask: causal keys never
reach beyond a real query, and padded queries are never counted.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from eagle_infer.heads import UnrolledMask
from eagle_infer.model import softcap

# Rows of target logits computed at once: rows x vocab floats stay around 64 MiB.
_LOGIT_ELEMS = 1 << 24


def shift_left(x: Tensor, n: int, fill: float | int | bool = 0) -> Tensor:
    """x[:, n:] padded with `fill` at the right end (dim 1), same shape as x."""
    if n == 0:
        return x
    pad = torch.full((x.shape[0], min(n, x.shape[1]), *x.shape[2:]), fill, dtype=x.dtype, device=x.device)
    return torch.cat([x[:, n:], pad], dim=1)


def ttt_mask(T: int, step: int, device: torch.device | str | None = None) -> Tensor:
    """[T, (step+1)*T] bool: causal over the step-0 keys, diagonal over the keys of steps 1..step."""
    causal = torch.ones(T, T, dtype=torch.bool, device=device).tril()
    eye = torch.eye(T, dtype=torch.bool, device=device)
    return torch.cat([causal] + [eye] * step, dim=-1)


def target_states(head, batch: dict) -> list[Tensor]:
    """The captured target states the head reads (EAGLE-3: the aux states, else the final one)."""
    if head.eagle3:
        if "aux" not in batch:
            from eagle_infer.errors import UserError

            raise UserError("an EAGLE-3 head needs the capture's aux hidden states, and this batch has "
                            "none (captured with capture.aux_layers=[]?): capture again with aux layers")
        return [batch["aux"]]
    return [batch["hidden"]]


def unroll(head, batch: dict, steps: int, noise: float = 0.0, compute_logits: bool = True,
           needed: Tensor | None = None) -> list[tuple[Tensor | None, Tensor]]:
    """Run `head` `steps` times over a batch, feeding its own g back (training-time test).

    batch: ``input_ids`` [B, T] and the target states (``hidden`` [B, T, H], ``aux`` [B, T, 3H]
    for EAGLE-3). ``noise`` adds uniform noise (rand - 0.5) * noise to the step-0 target states.
    Returns one ``(logits [B, T, V_draft] or None, g [B, T, H])`` per step; entry (t, s) is the
    prediction for position t+1+s (see the module docstring). Gradients flow through the
    whole unroll (features and keys of earlier steps).

    ``needed`` [B, T] bool (optional): the positions whose steps >= 1 matter. Step 0 always runs
    over every position (its keys are every later step's context); steps >= 1 then run on the
    needed positions only, gathered into a compact [B, M] batch, and come back scattered into
    [B, T] tensors that are zero elsewhere. Same results at the needed positions, a fraction of
    the compute when answers are a fraction of the tokens.
    """
    ids = batch["input_ids"]
    B, T = ids.shape
    dev = ids.device
    dtype = head.fc.weight.dtype
    states = [s.to(dtype) for s in target_states(head, batch)]
    if noise:
        states = [s + (torch.rand_like(s) - 0.5) * noise for s in states]
    feature = head.project(states)
    base = torch.arange(T, device=dev)[None, :].expand(B, T)
    if needed is None or steps <= 1:
        past: list[tuple[Tensor, Tensor]] = []
        out: list[tuple[Tensor | None, Tensor]] = []
        causal = ttt_mask(T, 0, dev)[None].expand(B, -1, -1)
        for s in range(steps):
            tokens = shift_left(ids, 1 + s)
            mask = causal if s == 0 else UnrolledMask(causal)
            logits, g, kv = head(tokens, feature, base + s, mask, past_kv=past, compute_logits=compute_logits)
            out.append((logits, g))
            past.append(kv)
            feature = g
        return out

    # Step 0 over all positions (causal), then steps >= 1 on the needed positions only.
    mask0 = ttt_mask(T, 0, dev)[None].expand(B, -1, -1)
    logits, g, kv0 = head(shift_left(ids, 1), feature, base, mask0, compute_logits=compute_logits)
    out = [(logits, g)]
    needed = needed.bool()
    cnt = needed.sum(1)
    M = max(1, int(cnt.max()))
    # Needed positions first (ascending), then filler positions whose results are dropped.
    tq = torch.sort((~needed).to(torch.uint8), dim=1, stable=True).indices[:, :M]  # [B, M]
    live = torch.arange(M, device=dev)[None, :] < cnt[:, None]
    lb, lm = live.nonzero(as_tuple=True)
    lt = tq[lb, lm]
    causal = UnrolledMask(torch.arange(T, device=dev)[None, None, :] <= tq[:, :, None])  # [B, M, T]
    feat = torch.gather(g, 1, tq[:, :, None].expand(B, M, g.shape[-1]))
    past = [kv0]
    for s in range(1, steps):
        tokens = torch.gather(shift_left(ids, 1 + s), 1, tq)
        logits_c, g_c, kv = head(tokens, feat, tq + s, causal, past_kv=past, compute_logits=compute_logits)
        g_full = g_c.new_zeros(B, T, g_c.shape[-1])
        g_full = g_full.index_put((lb, lt), g_c[lb, lm])
        logits_full = None
        if logits_c is not None:
            logits_full = logits_c.new_zeros(B, T, logits_c.shape[-1]).index_put((lb, lt), logits_c[lb, lm])
        out.append((logits_full, g_full))
        past.append(kv)
        feat = g_c
    return out


def needed_positions(loss_mask: Tensor, steps: int) -> Tensor:
    """[B, T] bool: pairs t some step >= 1 counts (see prediction_mask)."""
    need = torch.zeros_like(loss_mask, dtype=torch.bool)
    for s in range(1, steps):
        need |= prediction_mask(loss_mask, s)
    return need


def prediction_mask(loss_mask: Tensor, step: int) -> Tensor:
    """[B, T] bool: pair t at `step` predicts an assistant token x_{t+2+step} inside the sequence."""
    return shift_left(loss_mask.bool(), 2 + step, False)


@torch.no_grad()
def target_logits_rows(hidden_rows: Tensor, lm_head_w: Tensor, fn, chunk_elems: int = _LOGIT_ELEMS):
    """Apply fn(logits chunk) to lm_head(hidden_rows) chunk by chunk, without grad; results of
    fn (tuples of tensors) are concatenated along dim 0."""
    n = hidden_rows.shape[0]
    rows = max(1, chunk_elems // lm_head_w.shape[0])
    parts = []
    for i in range(0, n, rows):
        h = hidden_rows[i:i + rows].to(lm_head_w.dtype)
        parts.append(fn(F.linear(h, lm_head_w).float()))
    if not parts:
        return None
    return tuple(torch.cat(p, 0) for p in zip(*parts))


@torch.no_grad()
def target_argmax(hidden: Tensor, lm_head_w: Tensor) -> Tensor:
    """[B, T] argmax over the full vocabulary of lm_head(hidden), in chunks."""
    B, T, H = hidden.shape
    (am,) = target_logits_rows(hidden.reshape(B * T, H), lm_head_w, lambda lg: (lg.argmax(-1),))
    return am.view(B, T)


@dataclass
class LossOutput:
    loss: Tensor
    # Per unrolled step: summed soft-CE, top-1 hits and counted predictions (detached, float).
    ce_sum: Tensor
    correct: Tensor
    count: Tensor
    feature_sum: Tensor  # EAGLE-2 SmoothL1 summed over counted predictions (0 for EAGLE-3)

    def stats(self) -> Tensor:
        """One flat tensor (for a cross-process reduce): ce_sum | correct | count | feature_sum."""
        return torch.cat([self.ce_sum, self.correct, self.count, self.feature_sum])


def unpack_stats(stats: Tensor, steps: int) -> dict:
    ce, correct, count, feat = stats.split([steps, steps, steps, steps])
    n = count.clamp(min=1)
    return {
        "ce": (ce / n).tolist(),
        "acc": (correct / n).tolist(),
        "count": count.tolist(),
        "feature": (feat / n).tolist(),
    }


def draft_loss(head, batch: dict, lm_head_w: Tensor, *, steps: int, decay: float = 0.8,
               noise: float = 0.0, ce_weight: float = 1.0, feature_weight: float = 0.0,
               logit_softcap: float = 0.0) -> LossOutput:
    """Training-time-test loss of `head` on a batch.

    EAGLE-3: sum_s decay^s * soft-CE(target probs restricted to the draft vocabulary, draft
    log-probs), over the predictions whose target argmax lies in the draft vocabulary; top-1
    accuracy (``correct / count``) over all assistant predictions, out-of-vocabulary ones as misses.
    EAGLE-2: per step decay^s * (feature_weight * SmoothL1(g, f_{t+1+s}) + ce_weight * soft-CE
    over the full vocabulary); steps=1 is the published recipe.
    Each step's terms are means over its counted predictions. Target logits (lm_head_w @ f,
    soft-capped as the target caps them: logit_softcap, Gemma 2's) are computed once per batch, in
    chunks, without grad, at the positions some step needs.
    """
    ids, hidden = batch["input_ids"], batch["hidden"]
    B, T = ids.shape
    dev = ids.device
    loss_mask = batch["loss_mask"].bool()
    d2t = head.draft_to_target if head.eagle3 else None
    t2d = head.t2d if head.eagle3 else None

    # Target positions p any step predicts: x_{p+1} is an assistant token and p >= 1.
    need = shift_left(loss_mask, 1, False)
    need[:, 0] = False
    row_of = torch.full((B, T), -1, dtype=torch.long, device=dev)
    nb, npos = need.nonzero(as_tuple=True)
    row_of[nb, npos] = torch.arange(nb.numel(), device=dev)

    def labels(lg: Tensor):
        if logit_softcap:
            lg = softcap(lg, logit_softcap)
        am = lg.argmax(-1)
        sub = lg if d2t is None else lg[:, d2t]
        return torch.softmax(sub, -1), am

    res = target_logits_rows(hidden[nb, npos], lm_head_w, labels)
    if res is None:
        tgt_p = torch.zeros(0, lm_head_w.shape[0] if d2t is None else d2t.numel(), device=dev)
        tgt_am = torch.zeros(0, dtype=torch.long, device=dev)
    else:
        tgt_p, tgt_am = res

    outs = unroll(head, batch, steps, noise=noise, compute_logits=False,
                  needed=needed_positions(loss_mask, steps))
    total = hidden.new_zeros((), dtype=torch.float32)
    ce_sum = torch.zeros(steps, device=dev)
    correct = torch.zeros(steps, device=dev)
    count = torch.zeros(steps, device=dev)
    feat_sum = torch.zeros(steps, device=dev)
    for s, (_, g) in enumerate(outs):
        valid = prediction_mask(loss_mask, s)
        b, t = valid.nonzero(as_tuple=True)
        rows = row_of[b, t + 1 + s]
        am = tgt_am[rows]
        n_all = b.numel()
        # Accuracy is over every assistant prediction: one whose target token lies outside the
        # draft vocabulary is a guaranteed rejection in serving, so it counts as a miss (leaving
        # it out of the denominator read optimistic). CE stays a mean over the in-vocabulary
        # predictions (the loss needs the target's choice drawable by the draft): a weight, not a
        # boolean filter, so that a GPU does not wait for the host to learn how many there are;
        # its sum is scaled to n_all so that ce_sum / count is it.
        keep = torch.ones_like(am, dtype=torch.float32) if t2d is None else t2d[am].float()
        n = keep.sum().clamp(min=1)
        count[s] = n_all
        if n_all == 0:
            # Keep every parameter in the graph (DDP expects a gradient for each of them).
            total = total + 0.0 * head.logits(g[:1, :1]).float().sum()
            continue
        gs = g[b, t]
        logp = torch.log_softmax(head.logits(gs).float(), -1)
        ce = -(tgt_p[rows] * logp).sum(-1) * keep
        step_loss = ce_weight * ce.sum() / n
        with torch.no_grad():
            pred = logp.argmax(-1)
            pred = d2t[pred] if d2t is not None else pred
            correct[s] = (pred == am).sum()  # an out-of-vocabulary target is never drawn: a miss
            ce_sum[s] = ce.detach().sum() * (n_all / n)
        if feature_weight:
            fl = F.smooth_l1_loss(gs.float(), hidden[b, t + 1 + s].float(), reduction="none").mean(-1) * keep
            step_loss = step_loss + feature_weight * fl.sum() / n
            feat_sum[s] = fl.detach().sum()
        total = total + (decay ** s) * step_loss
    return LossOutput(total, ce_sum, correct, count, feat_sum)


@torch.no_grad()
def leading_matches(head, batch: dict, lm_head_w: Tensor, steps: int) -> tuple[Tensor, Tensor, Tensor]:
    """Chain-draft agreement on a batch, as drafting sees it (no noise).

    Returns (match [B, T, steps] bool, valid [B, T, steps] bool, lead [B, T] long): whether the
    draft's argmax (mapped to target ids) equals the target's argmax for pair t at step k,
    whether that prediction is counted (assistant token inside the sequence), and the number
    of leading consecutive matches (the chain stops at the first miss or the first uncounted
    position, as a draft does at the end of an answer).
    """
    loss_mask = batch["loss_mask"].bool()
    outs = unroll(head, batch, steps, noise=0.0, compute_logits=False,
                  needed=needed_positions(loss_mask, steps))
    tgt = target_argmax(batch["hidden"], lm_head_w)
    d2t = head.draft_to_target
    match, valid = [], []
    for s, (_, g) in enumerate(outs):
        v = prediction_mask(loss_mask, s)
        pred = torch.full_like(tgt, -1)
        pred[v] = _argmax_logits(head, g[v])
        if d2t is not None:
            pred[v] = d2t[pred[v]]
        match.append((pred == shift_left(tgt, 1 + s)) & v)
        valid.append(v)
    m = torch.stack(match, -1)
    v = torch.stack(valid, -1)
    ok = (m & v).long()
    lead = ok.cumprod(-1).sum(-1)
    return m, v, lead


def _argmax_logits(head, g: Tensor) -> Tensor:
    """argmax of head.logits(g) over rows g [N, H], a few rows at a time (EAGLE-2 logits span
    the whole vocabulary)."""
    rows = max(1, _LOGIT_ELEMS // max(1, _draft_vocab(head)))
    parts = [head.logits(g[i:i + rows]).argmax(-1) for i in range(0, g.shape[0], rows)]
    return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.long, device=g.device)


def _draft_vocab(head) -> int:
    if head.draft_lm_head is not None:
        return head.draft_lm_head.shape[0]
    return head.config.draft_vocab_size if head.eagle3 else head.config.vocab_size

