"""Tree acceptance on-device: a fused Triton kernel per round (CUDA) and a pure-torch reference.

Both walk the draft tree from the root and return the accepted path, the number of accepted
draft tokens and the bonus token, with no host reads. The reference and the kernel follow one
contract, operation for operation, so given the same inputs (including the same uniforms) they
agree exactly; tests/test_tree_accept_kernel.py checks that under TRITON_INTERPRET=1.

Greedy: a child is accepted iff its token is the target's argmax after its parent; the first
such child (in node order) is followed. Siblings hold distinct tokens (draft_tree takes a
top-k), so this is the deepest all-matching path, as `tree.accept_greedy` returns.

Sampling (lossless multi-draft rejection sampling with deterministic drafts, SpecInfer/EAGLE):
at a node at depth d with target distribution p, its children are tried in node order, child r
with uniform u[d, r], and accepted with probability p(x_r) / (mass not yet rejected); on
rejection p(x_r) is zeroed and the next child is tried. If every child is rejected (or the node
has none), the walk stops and the bonus token is drawn from the residual (p with the tried
children's tokens zeroed) by inverse CDF at u[d, max_children]. Only the first `max_children`
children of a node are tried; leaving drafts untried is still lossless (it only shortens
acceptance), and `max_children = N - 1` never leaves any out. A sibling repeating an earlier
sibling's token finds p(x) already zeroed (never accepted). The walk stops at depth num_steps;
a leaf reached there was not tried, so its residual is its full p.

Masses are fixed-point integers, so that sums are exact and the kernel's block-wise scans and
torch's cumsum agree whatever order they add in: q(x) = trunc(p(x) * 2^60) (int64; exact for
fp32 p). Child r is accepted iff
    p(x_r) > 0 and (u[d, r] * rem_r < p(x_r) or q(x_r) >= remq_r),
    remq_r = 2^60 - sum_{s < r} q(x_s),  rem_r = fp32(remq_r) * 2^-60,
the renormalised test without a division; the second clause accepts a child that holds all the
remaining mass even when rounding leaves rem a hair above p(x). The bonus: the uniform becomes
m = trunc(u * 2^24), the threshold t = floor(m * total / 2^24) over the residual's total q, and
the bonus is the number of tokens whose inclusive prefix sum of q is <= t (searchsorted with
right=True, as `sampling.sample`: never a zero-probability token). If rounding left the residual
with no mass at all, the bonus is drawn from the node's full p instead.

Uniforms: [B, num_steps + 1, max_children + 1] fp32 in [0, 1); u[b, d, r < max_children] tries
child r at depth d, u[b, d, max_children] draws the bonus when the walk stops at depth d.
"""

from __future__ import annotations

import functools
import os
from typing import NamedTuple

import torch
from torch import Tensor

_Q_SCALE = 2.0 ** 60  # fixed-point scale of probabilities for the integer inverse CDF
_U_BITS = 24  # bits of the bonus uniform that are used (torch.rand's fp32 resolution)


class TreeAccept(NamedTuple):
    path: Tensor  # [B, num_steps + 1] accepted node indices from the root, padded with the leaf
    n_accepted: Tensor  # [B] accepted draft tokens (the root not counted)
    bonus: Tensor  # [B] the target's token after the accepted path


# -- pure-torch references (any device) ------------------------------------------------------------


def _walk(nxt: Tensor, num_steps: int) -> tuple[Tensor, Tensor]:
    """Follow nxt [B, N] (accepted child of each node, or -1) from the root for num_steps steps:
    (path [B, num_steps + 1], n_accepted [B])."""
    B = nxt.shape[0]
    node = torch.zeros(B, dtype=torch.long, device=nxt.device)
    path = [node]
    for _ in range(num_steps):
        c = torch.gather(nxt, 1, node[:, None])[:, 0]
        node = torch.where(c >= 0, c, node)  # a stopped walk stays put: nxt is fixed per node
        path.append(node)
    path_t = torch.stack(path, 1)
    return path_t, (path_t[:, 1:] != path_t[:, :-1]).sum(1)


def accept_greedy_reference(tokens: Tensor, parent: Tensor, pred: Tensor, num_steps: int) -> TreeAccept:
    """tokens, parent [B, N]; pred [B, N] the target's argmax after each node."""
    B, N = tokens.shape
    nodes = torch.arange(N, device=tokens.device)
    ok = (tokens == torch.gather(pred, 1, parent)) & (nodes > 0)  # [B, N] matches its parent's argmax
    is_kid = (parent[:, None, :] == nodes[None, :, None]) & ok[:, None, :]  # [B, node, child]
    first = torch.where(is_kid, nodes, N).amin(-1)  # [B, N] first matching child, N = none
    path, n = _walk(torch.where(first < N, first, -1), num_steps)
    return TreeAccept(path, n, torch.gather(pred, 1, path[:, -1:])[:, 0])


def _children(parent: Tensor, max_children: int) -> Tensor:
    """[B, N] parent pointers -> [B, N, max_children]: each node's first children in node order,
    N where there are fewer."""
    B, N = parent.shape
    nodes = torch.arange(N, device=parent.device)
    is_kid = (parent[:, None, :] == nodes[None, :, None]) & (nodes > 0)  # [B, node, child]
    rank = is_kid.cumsum(-1) - 1
    slot = torch.where(is_kid & (rank < max_children), rank, max_children)  # overflow -> a dump slot
    kids = torch.full((B, N, max_children + 1), N, dtype=torch.long, device=parent.device)
    kids.scatter_(2, slot, torch.where(slot < max_children, nodes, N).expand(B, N, N).contiguous())
    return kids[:, :, :max_children]


def _draw_bonus(p: Tensor, tried: Tensor, tried_q: Tensor, u: Tensor) -> Tensor:
    """Integer inverse CDF (see the module doc). p [B, V] fp32; tried [B, T] the token ids to zero
    (V = none; repeats allowed); tried_q [B] their total q, each token counted once; u [B] fp32
    -> [B] token ids. Five passes over V (as few as this takes: it is most of the time)."""
    B, V = p.shape
    q = (p * _Q_SCALE).long()  # [B, V] exact: fp32 * 2^60 is exact, and >= 2^24 is an integer
    full = q.sum(-1)
    resid = full - tried_q  # integers: the same total as summing the zeroed row
    use_resid = resid > 0
    total = torch.where(use_resid, resid, full)
    # Zero the tried tokens, unless falling back to the full row. amin: a dummy entry (index 0,
    # value q[0]) never undoes a real zero there. In place on q, a fresh tensor.
    idx = torch.where(tried < V, tried, 0)
    q.scatter_reduce_(1, idx, torch.where((tried < V) & use_resid[:, None], 0, q.gather(1, idx)), "amin")
    m = (u * float(1 << _U_BITS)).long().clamp_(0, (1 << _U_BITS) - 1)
    low = (1 << _U_BITS) - 1
    t = (total >> _U_BITS) * m + (((total & low) * m) >> _U_BITS)  # floor(m * total / 2^24), no overflow
    # The number of inclusive prefix sums <= t (exact in int64, whatever order they add in).
    return torch.searchsorted(q.cumsum(-1), t[:, None], right=True)[:, 0].clamp_(max=V - 1)


def accept_sampling_reference(tokens: Tensor, parent: Tensor, depth: Tensor, probs: Tensor,
                              uniforms: Tensor) -> TreeAccept:
    """tokens, parent, depth [B, N]; probs [B, N, V] fp32, the target's distribution after each
    node; uniforms [B, num_steps + 1, max_children + 1] fp32 in [0, 1).

    Vectorised: the accept/reject chain is evaluated at every node and child at once (with the
    uniforms of that node's depth); then the walk follows the accepted child per node,
    num_steps gathers. No host reads."""
    B, N = tokens.shape
    V = probs.shape[-1]
    num_steps, R = uniforms.shape[1] - 1, uniforms.shape[2] - 1
    probs, uniforms = probs.float(), uniforms.float()
    kids = _children(parent, R)  # [B, N, R]
    valid = kids < N
    kid_tok = torch.gather(torch.cat([tokens, tokens.new_zeros(B, 1)], 1), 1, kids.flatten(1)).view(B, N, R)
    # A sibling repeating an earlier sibling's token finds p(x) already zeroed by its rejection.
    earlier = torch.ones(R, R, dtype=torch.bool, device=tokens.device).tril(-1)  # [r, s]: s < r
    repeat = ((kid_tok[..., :, None] == kid_tok[..., None, :]) & valid[..., None, :] & earlier).any(-1)
    px = torch.where(valid & ~repeat, torch.gather(probs, 2, kid_tok), 0.0)  # [B, N, R] p(x_r)
    qx = (px * _Q_SCALE).long()
    rem_q = (1 << 60) - (qx.cumsum(-1) - qx)  # mass left before each try, exact in integers
    rem = rem_q.float() * 2.0 ** -60
    u = torch.gather(uniforms, 1, depth.clamp(max=num_steps)[:, :, None].expand(B, N, R + 1))[..., :R]
    ok = valid & (px > 0) & ((u * rem < px) | (qx >= rem_q))  # [B, N, R]
    first = torch.where(ok, torch.arange(R, device=tokens.device), R).amin(-1)  # [B, N] first accepted rank
    nxt = torch.where(first < R, torch.gather(kids, 2, first.clamp(max=R - 1)[:, :, None])[:, :, 0], -1)
    path, n = _walk(nxt, num_steps)
    leaf = path[:, -1]
    # The leaf's children were all tried and rejected, unless the walk ran out of steps there.
    at_leaf = leaf[:, None, None].expand(B, 1, R)
    leaf_valid = torch.gather(valid, 1, at_leaf)[:, 0] & (n < num_steps)[:, None]  # [B, R]
    tried = torch.where(leaf_valid, torch.gather(kid_tok, 1, at_leaf)[:, 0], V)
    tried_q = torch.where(leaf_valid, torch.gather(qx, 1, at_leaf)[:, 0], 0).sum(-1)  # repeats have qx 0
    p_leaf = torch.gather(probs, 1, leaf[:, None, None].expand(B, 1, V))[:, 0]
    u_bonus = torch.gather(uniforms[:, :, R], 1, n[:, None])[:, 0]
    return TreeAccept(path, n, _draw_bonus(p_leaf, tried, tried_q, u_bonus))


# -- the Triton kernels (CUDA; CPU only under TRITON_INTERPRET=1) ----------------------------------


@functools.cache
def _triton_ok() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def kernel_available(t: Tensor) -> bool:
    """Whether the fused kernels should run for tensors like t: on CUDA, with triton installed.
    (Under TRITON_INTERPRET=1 they run anywhere, slowly: tests call them directly, and callers
    that dispatch on this keep the torch path there.)"""
    # Inside a graph being compiled the torch walk is traced instead: Inductor fuses it with the rest.
    return (t.is_cuda and os.environ.get("TRITON_INTERPRET") != "1" and not torch.compiler.is_compiling()
            and _triton_ok())


def _next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def fused_accept_greedy(tokens: Tensor, parent: Tensor, pred: Tensor, num_steps: int) -> TreeAccept:
    """The greedy walk in one launch, one program per row. pred: [B, N] argmax ids, or the
    target logits [B, N, V] (the argmax is then taken here, by torch)."""
    from eagle_infer.kernels import _tree_accept_triton as k

    if pred.dim() == 3:
        pred = pred.argmax(-1)
    B, N = tokens.shape
    dev = tokens.device
    path = torch.empty(B, num_steps + 1, dtype=torch.long, device=dev)
    n = torch.empty(B, dtype=torch.long, device=dev)
    bonus = torch.empty(B, dtype=torch.long, device=dev)
    k.accept_greedy_kernel[(B,)](
        tokens.long().contiguous(), parent.long().contiguous(), pred.long().contiguous(), path, n, bonus, N,
        NUM_STEPS=num_steps, BLOCK_N=_next_pow2(N))
    return TreeAccept(path, n, bonus)


def fused_accept_sampling(tokens: Tensor, parent: Tensor, probs: Tensor, uniforms: Tensor,
                          block_v: int | None = None) -> TreeAccept:
    """The sampled walk and the bonus draw in one launch, one program per row; the same contract
    as accept_sampling_reference (which takes depth too: the kernel counts it while walking).
    block_v: the vocabulary tile, a power of two (default: chosen from N; tests pass a small
    one to cross tiles)."""
    from eagle_infer.kernels import _tree_accept_triton as k

    B, N = tokens.shape
    V = probs.shape[-1]
    num_steps, R = uniforms.shape[1] - 1, uniforms.shape[2] - 1
    dev = tokens.device
    path = torch.empty(B, num_steps + 1, dtype=torch.long, device=dev)
    n = torch.empty(B, dtype=torch.long, device=dev)
    bonus = torch.empty(B, dtype=torch.long, device=dev)
    block_n = _next_pow2(N)
    # The residual pass compares each vocabulary block with the leaf's child tokens: keep
    # BLOCK_V x BLOCK_N near 16k elements.
    block_v = block_v or max(16, min(1024, 16384 // block_n, _next_pow2(V)))
    k.accept_sampling_kernel[(B,)](
        tokens.long().contiguous(), parent.long().contiguous(), probs.float().contiguous(),
        uniforms.float().contiguous(), path, n, bonus, N, V,
        NUM_STEPS=num_steps, R=R, BLOCK_N=block_n, BLOCK_V=block_v)
    return TreeAccept(path, n, bonus)
