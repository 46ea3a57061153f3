"""Triton kernels for eagle_infer.kernels.tree_accept (imported lazily: this imports triton).

Each follows the contract in tree_accept's module doc operation for operation, so that its
result equals the torch reference exactly. One program per batch row; a row's tree (N <= a few
hundred nodes) lives in registers as [BLOCK_N] vectors, and the walk is unrolled over depth.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def accept_greedy_kernel(tokens_ptr, parent_ptr, pred_ptr, path_ptr, n_ptr, bonus_ptr, N,
                         NUM_STEPS: tl.constexpr, BLOCK_N: tl.constexpr):
    b = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK_N)
    in_tree = offs < N
    parent = tl.load(parent_ptr + b * N + offs, mask=in_tree, other=0).to(tl.int32)
    tokens = tl.load(tokens_ptr + b * N + offs, mask=in_tree, other=-1)
    pred_of_parent = tl.load(pred_ptr + b * N + parent, mask=in_tree, other=-2)
    ok = (tokens == pred_of_parent) & in_tree & (offs > 0)  # [BLOCK_N] the target agrees with it
    node = tl.zeros([], dtype=tl.int32)
    moves = tl.zeros([], dtype=tl.int64)
    tl.store(path_ptr + b * (NUM_STEPS + 1), node.to(tl.int64))
    for d in tl.static_range(NUM_STEPS):
        c = tl.min(tl.where((parent == node) & ok, offs, BLOCK_N), 0)  # first matching child
        moved = c < BLOCK_N
        node = tl.where(moved, c, node)  # no match: stays, and will not match later either
        moves += moved.to(tl.int64)
        tl.store(path_ptr + b * (NUM_STEPS + 1) + d + 1, node.to(tl.int64))
    tl.store(n_ptr + b, moves)
    tl.store(bonus_ptr + b, tl.load(pred_ptr + b * N + node))


@triton.jit
def accept_sampling_kernel(tokens_ptr, parent_ptr, probs_ptr, u_ptr, path_ptr, n_ptr, bonus_ptr, N, V,
                           NUM_STEPS: tl.constexpr, R: tl.constexpr, BLOCK_N: tl.constexpr,
                           BLOCK_V: tl.constexpr):
    b = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK_N)
    in_tree = offs < N
    parent = tl.load(parent_ptr + b * N + offs, mask=in_tree, other=-1).to(tl.int32)
    tokens = tl.load(tokens_ptr + b * N + offs, mask=in_tree, other=0)
    u_row = u_ptr + b * ((NUM_STEPS + 1) * (R + 1))
    node = tl.zeros([], dtype=tl.int32)
    moves = tl.zeros([], dtype=tl.int64)
    active = tl.full([], 1, dtype=tl.int32)  # 0 once a node rejected all its children
    tl.store(path_ptr + b * (NUM_STEPS + 1), node.to(tl.int64))
    for d in tl.static_range(NUM_STEPS):
        # All of the node's children at once (few reductions: each is costly in the interpreter).
        is_kid = (parent == node) & (offs > 0)
        rank = tl.cumsum(is_kid.to(tl.int32), 0) - 1
        tried = is_kid & (rank < R)  # the children that get a try, in node order
        # A sibling repeating an earlier sibling's token finds p(x) already zeroed by its rejection.
        repeat = (tokens[:, None] == tokens[None, :]) & tried[None, :] & (offs[None, :] < offs[:, None])
        first_try = tried & (tl.max(repeat.to(tl.int32), 1) == 0)
        px = tl.load(probs_ptr + (b * N + node) * V + tokens, mask=first_try, other=0.0)  # [BLOCK_N]
        qx = (px * 1152921504606846976.0).to(tl.int64)  # * 2^60, exact in fp32
        rem_q = 1152921504606846976 - (tl.cumsum(qx, 0) - qx)  # mass left before each try, exact
        rem = rem_q.to(tl.float32) * 8.673617379884035e-19  # * 2^-60
        u = tl.load(u_row + d * (R + 1) + rank, mask=tried, other=1.0)
        ok = tried & (px > 0) & ((u * rem < px) | (qx >= rem_q))
        c = tl.min(tl.where(ok, offs, BLOCK_N), 0)  # the first accepted child
        moved = (c < BLOCK_N) & (active > 0)
        node = tl.where(moved, c, node)
        moves += moved.to(tl.int64)
        active = moved.to(tl.int32)  # a stopped walk never resumes (later depths' uniforms unused)
        tl.store(path_ptr + b * (NUM_STEPS + 1) + d + 1, node.to(tl.int64))

    # Bonus from the leaf's residual. If the walk stopped, the last step ran at the leaf: its
    # tries are `tried`, all rejected. If it moved at every step, nothing was tried at the leaf.
    tried = tried & (active == 0)
    tried_q = tl.sum(tl.where(tried, qx, 0), 0)
    tried_tok = tl.where(tried, tokens, -1)  # [BLOCK_N], -1 = none
    p_row = probs_ptr + (b * N + node) * V
    u_b = tl.load(u_row + moves * (R + 1) + R)
    full = tl.zeros([], dtype=tl.int64)
    for v0 in range(0, V, BLOCK_V):
        offs_v = v0 + tl.arange(0, BLOCK_V)
        p = tl.load(p_row + offs_v, mask=offs_v < V, other=0.0)
        full += tl.sum((p * 1152921504606846976.0).to(tl.int64), 0)
    resid = full - tried_q  # integers: the same total as summing the zeroed row
    use_resid = resid > 0
    total = tl.where(use_resid, resid, full)
    m = tl.minimum(tl.maximum((u_b * 16777216.0).to(tl.int64), 0), 16777215)  # 24-bit uniform
    t = (total >> 24) * m + (((total & 16777215) * m) >> 24)  # floor(m * total / 2^24)
    count = tl.zeros([], dtype=tl.int64)
    run = tl.zeros([], dtype=tl.int64)
    for v0 in range(0, V, BLOCK_V):
        offs_v = v0 + tl.arange(0, BLOCK_V)
        p = tl.load(p_row + offs_v, mask=offs_v < V, other=0.0)
        q = (p * 1152921504606846976.0).to(tl.int64)
        hit = tl.max((offs_v[:, None] == tried_tok[None, :]).to(tl.int32), 1) > 0
        q = tl.where(hit & use_resid, 0, q)
        cdf = tl.cumsum(q, 0) + run  # integer: exact whatever order the scan adds in
        count += tl.sum(((cdf <= t) & (offs_v < V)).to(tl.int64), 0)
        run += tl.sum(q, 0)
    tl.store(n_ptr + b, moves)
    tl.store(bonus_ptr + b, tl.minimum(count, V - 1))
