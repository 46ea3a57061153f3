"""The fused tree-accept kernels (eagle_infer/kernels) against their torch references.

The Triton kernels run on this CPU under TRITON_INTERPRET=1. That variable must be set before
triton is first imported, and must not leak into other tests, so the kernel checks run in a
child process: this file, run as a script (`python tests/test_tree_accept_kernel.py` with
TRITON_INTERPRET=1), computes every kernel case and prints one JSON line; the tests below read
it. The references themselves (no triton) are checked in this process: the greedy one against
`tree.accept_greedy`, the sampled one for losslessness (chi-square) at full statistical power.

The interpreter runs a kernel program in ~20-60 ms of Python per row here, so kernel cases are
small (V 16-256, a few hundred rows in all).
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from scipy.stats import chisquare

from eagle_infer.kernels.tree_accept import (
    TreeAccept,
    accept_greedy_reference,
    accept_sampling_reference,
    kernel_available,
)
from eagle_infer.sampling import logits_to_probs
from eagle_infer.tree import DraftTree, accept_greedy, ancestor_mask

# -- inputs shared by this process and the interpreter worker ---------------------------------------


Tensor = torch.Tensor


def random_tree(g: torch.Generator, B: int, N: int, num_steps: int, V: int, max_kids: int | None = None,
                chain: bool = False, distinct: bool = True) -> tuple[Tensor, Tensor, Tensor]:
    """(tokens, parent, depth) [B, N]: node j's parent is an earlier node of depth < num_steps
    (with fewer than max_kids children); tokens distinct within a row unless distinct=False."""
    parent = torch.zeros(B, N, dtype=torch.long)
    depth = torch.zeros(B, N, dtype=torch.long)
    for b in range(B):
        kids = [0] * N
        for j in range(1, N):
            if chain:
                i = j - 1
            else:
                room = max_kids or N
                ok = [i for i in range(j) if depth[b, i] < num_steps and kids[i] < room]
                i = ok[int(torch.randint(len(ok), (), generator=g))]
            parent[b, j], depth[b, j] = i, depth[b, i] + 1
            kids[i] += 1
    if distinct:
        tokens = torch.stack([torch.randperm(V, generator=g)[:N] for _ in range(B)])
    else:  # few distinct values: siblings repeat tokens
        tokens = torch.randint(0, 3, (B, N), generator=g)
    return tokens, parent, depth


def boosted_logits(g: torch.Generator, tokens: torch.Tensor, parent: torch.Tensor, V: int,
                   boost: float) -> torch.Tensor:
    """Random logits [B, N, V] with each child's token raised at its parent, so that drafts are
    accepted often enough to exercise deep paths."""
    B, N = tokens.shape
    logits = torch.randn(B, N, V, generator=g)
    bump = torch.zeros(B, N, V)
    bump.scatter_add_(2, tokens[:, None, :].expand(B, N, N),
                      (parent[:, None, :] == torch.arange(N)[None, :, None]).float() * boost)
    return logits + bump


def greedy_pred(g: torch.Generator, tokens: torch.Tensor, parent: torch.Tensor, V: int,
                match: float) -> torch.Tensor:
    """[B, N] argmax per node: one of the node's children's tokens with probability `match`."""
    B, N = tokens.shape
    pred = torch.randint(0, V, (B, N), generator=g)
    for b in range(B):
        for j in range(N):
            kids = [c for c in range(1, N) if parent[b, c] == j]
            if kids and float(torch.rand((), generator=g)) < match:
                pred[b, j] = tokens[b, kids[int(torch.randint(len(kids), (), generator=g))]]
    return pred


def make_case(name: str) -> dict:
    """Inputs of one named kernel case (deterministic), plus which edge it must hit."""
    g = torch.Generator().manual_seed(sum(map(ord, name)))
    S, R, V, B, N = 4, 3, 64, 4, 12
    settings = dict(temperature=1.0, top_p=1.0, top_k=0)
    boost, tree_kw, edge = 4.5, {}, None
    if name == "chain":
        S, N, R, tree_kw = 5, 6, 1, dict(chain=True)
    elif name == "wide":  # the root has more children than are tried
        S, N, R, tree_kw = 2, 9, 3, dict(max_kids=8)
    elif name == "random_b8":
        S, N, R, V, B, tree_kw, boost = 5, 16, 15, 256, 8, dict(max_kids=4), 6.0  # R = N - 1, as tree.py
        settings = dict(temperature=0.7, top_p=0.9, top_k=0)
    elif name == "topk_topp":
        N, R, V = 10, 4, 128
        settings = dict(temperature=1.3, top_p=0.8, top_k=20)
    elif name == "vocab_tiles":  # the kernel scans V in tiles of 32: prefix sums carry across tiles
        V, B, R, boost = 200, 6, 3, 1.0
    elif name == "untried":  # R = 1 on bushy trees: later siblings are never tried
        N, R = 12, 1
    elif name == "duplicates":
        N, R, tree_kw = 10, 4, dict(distinct=False)
    elif name == "greedy_rows":  # temperature 0: one-hot p, must act as accept_greedy
        settings = dict(temperature=0.0, top_p=1.0, top_k=0)
        edge = "greedy"
    elif name in ("nothing_accepted", "whole_path", "all_rejected", "empty_residual"):
        S, N, R, tree_kw = 3, 7, 3, dict(max_kids=3)
        edge = name
    tokens, parent, depth = random_tree(g, B, N, S, V, **tree_kw)
    logits = boosted_logits(g, tokens, parent, V, boost)
    probs = logits_to_probs(logits, **settings)
    u = torch.rand(B, S + 1, R + 1, generator=g)
    if name == "greedy_rows":
        pred = logits.argmax(-1)
    else:
        pred = greedy_pred(g, tokens, parent, V, match=0.8)
    kid_of = parent[:, None, :] == torch.arange(N)[None, :, None]  # [B, node, child]
    kid_of[:, :, 0] = False
    kid_tok = torch.where(kid_of, tokens[:, None, :], V)  # [B, node, child], V = not a child
    if edge == "nothing_accepted":  # the target gives the root's children no mass at all
        root = torch.cat([probs[:, 0], torch.zeros(B, 1)], 1).scatter(1, kid_tok[:, 0], 0.0)[:, :V]
        probs[:, 0] = root / root.sum(-1, keepdim=True)
    elif edge == "whole_path":  # one-hot on the child with the deepest subtree: the deepest path
        height = torch.zeros(B, N, dtype=torch.long)  # levels below each node
        for j in range(N - 1, 0, -1):
            par = parent[:, j:j + 1]
            height.scatter_reduce_(1, par, height[:, j:j + 1] + 1, "amax")
        probs = torch.zeros(B, N, V)
        probs[:, :, 0] = 1.0  # leaves: any bonus
        for b in range(B):
            for j in range(N):
                kids = [c for c in range(1, N) if parent[b, c] == j]
                if kids:  # the last of the tallest: earlier siblings get p = 0 and are skipped
                    best = max(kids, key=lambda c: (int(height[b, c]), c))
                    probs[b, j] = 0.0
                    probs[b, j, tokens[b, best]] = 1.0
        pred = probs.argmax(-1)
    elif edge == "all_rejected":  # mass on the children, but every try draws u ~ 1
        u[:, :, :R] = 1.0 - 2.0 ** -24
    elif edge == "empty_residual":  # an unnormalised row whose mass sits on the tried children
        probs[:, 0] = 0.0
        for b in range(B):
            kids = kid_tok[b, 0][kid_tok[b, 0] < V]
            probs[b, 0, kids] = torch.linspace(0.1, 0.3, len(kids))  # sums to < 1: never px >= rem
        u[:, 0, :R] = 1.0 - 2.0 ** -24
    return dict(tokens=tokens, parent=parent, depth=depth, probs=probs.contiguous(), uniforms=u, pred=pred,
                num_steps=S, edge=edge, block_v=32 if name == "vocab_tiles" else None)


KERNEL_CASES = ["chain", "wide", "random_b8", "topk_topp", "vocab_tiles", "untried", "duplicates",
                "greedy_rows", "nothing_accepted", "whole_path", "all_rejected", "empty_residual"]


def check_edge(case: dict, acc: TreeAccept) -> str | None:
    """None if the case hit the edge it is named for, else what went wrong."""
    edge, S, tokens = case["edge"], case["num_steps"], case["tokens"]
    n, bonus = acc.n_accepted, acc.bonus
    if edge in ("nothing_accepted", "all_rejected", "empty_residual") and n.ne(0).any():
        return f"{edge}: accepted {n.tolist()}"
    if edge == "whole_path" and (n.ne(case["depth"].amax(1)).any() or n.max() < S):
        return f"whole_path: accepted {n.tolist()} of {case['depth'].amax(1).tolist()}"
    kids_of_root = [set(tokens[b][(case["parent"][b] == 0) & (torch.arange(tokens.shape[1]) > 0)].tolist())
                    for b in range(tokens.shape[0])]
    if edge in ("nothing_accepted", "all_rejected"):  # the bonus comes from the residual
        if any(int(bonus[b]) in kids_of_root[b] for b in range(len(kids_of_root))):
            return f"{edge}: the bonus is a rejected child's token"
    if edge == "empty_residual":  # fell back to the full row: the bonus is one of the children
        if any(int(bonus[b]) not in kids_of_root[b] for b in range(len(kids_of_root))):
            return "empty_residual: the bonus is not from the node's full distribution"
    return None


def as_tree(case: dict) -> DraftTree:
    mask = ancestor_mask(case["parent"], case["num_steps"])
    return DraftTree(case["tokens"], case["parent"], case["depth"], mask)


def _fields(acc) -> tuple[Tensor, Tensor, Tensor]:
    """tree.Acceptance -> its three tensors."""
    return acc.path, acc.n_accepted, acc.bonus


def equal(a: TreeAccept, b: TreeAccept) -> bool:
    return all(torch.equal(x.long(), y.long()) for x, y in zip(a, b))


# -- the interpreter worker (run as a script) ---------------------------------------------------------


def _speed_up_interpreter() -> None:
    """Test-only: Triton's interpreter re-patches triton.language on every device-function call
    (tl.sum, tl.max, tl.cumsum are @jit functions), ~3 ms each on a loaded CPU. Patching once
    per function halves the kernels' run time here; best effort, skipped if internals differ."""
    try:
        from triton.runtime import interpreter as ti

        fn_cls, patch, err = ti.InterpretedFunction, ti._patch_lang, ti.InterpreterError
        if not callable(getattr(fn_cls, "rewrite", None)):
            return
    except (ImportError, AttributeError):
        return
    patched: set = set()

    def call(self, *args, **kwargs):
        if self.fn not in patched:
            patch(self.fn)
            patched.add(self.fn)
        try:
            return self.rewrite()(*args, **kwargs)
        except Exception as e:
            raise err(repr(e)) from e

    fn_cls.__call__ = call


def _first_token_counts(kernel: bool, n: int, seed: int) -> tuple[list[float], list[int]]:
    """A fixed root distribution p over V = 8 with three drafted children; n rows with fresh
    uniforms: (p, counts of the first emitted token)."""
    from eagle_infer.kernels.tree_accept import fused_accept_sampling

    V = 8
    p = torch.tensor([0.30, 0.05, 0.20, 0.0, 0.15, 0.10, 0.12, 0.08])
    tokens = torch.tensor([[6, 0, 4, 2]]).expand(n, 4).contiguous()  # root 6; children 0, 4, 2
    parent = torch.tensor([[0, 0, 0, 0]]).expand(n, 4).contiguous()
    probs = torch.zeros(n, 4, V)
    probs[:, 0] = p
    probs[:, 1:] = 1.0 / V
    u = torch.rand(n, 2, 4, generator=torch.Generator().manual_seed(seed))
    if kernel:
        acc = fused_accept_sampling(tokens, parent, probs, u)
    else:
        depth = torch.tensor([[0, 1, 1, 1]]).expand(n, 4)
        acc = accept_sampling_reference(tokens, parent, depth, probs, u)
    first = torch.where(acc.n_accepted > 0, torch.gather(tokens, 1, acc.path[:, 1:2])[:, 0], acc.bonus)
    return p.tolist(), torch.bincount(first, minlength=V).tolist()


def _tree_dispatch() -> dict:
    """tree.accept_greedy / accept_sampling with their CUDA branch forced (kernel_available is
    True only on CUDA): the same greedy acceptance as their torch path, greedy rows through
    accept_sampling too, and the first sampled token (through the uniforms tree.py lays out
    for the kernel) following the target's root distribution."""
    from eagle_infer import tree as tree_mod
    from eagle_infer.sampling import SamplingParams

    c = make_case("random_b8")
    t, S = as_tree(c), c["num_steps"]
    B = c["tokens"].shape[0]
    logits = torch.nn.functional.one_hot(c["pred"], c["probs"].shape[-1]).float()
    logits = logits + 0.01 * torch.randn(logits.shape, generator=torch.Generator().manual_seed(5))
    torch_path = tree_mod.accept_greedy(t, logits, S)
    n, V = 400, 8
    tok1 = torch.tensor([[5, 1, 2, 3]]).expand(n, 4)
    par1 = torch.tensor([[0, 0, 0, 1]]).expand(n, 4)
    t1 = DraftTree(tok1, par1, torch.tensor([[0, 1, 1, 2]]).expand(n, 4), ancestor_mask(par1, 2))
    lg = torch.randn(1, 4, V, generator=torch.Generator().manual_seed(6)).expand(n, 4, V)
    params = [SamplingParams(temperature=1.0, seed=i) for i in range(n)]
    saved = tree_mod.kernel_available
    tree_mod.kernel_available = lambda x: True
    try:
        kernel_path = tree_mod.accept_greedy(t, logits, S)
        greedy = [SamplingParams(temperature=0.0)] * B
        greedy_rows = tree_mod.accept_sampling(t, logits, greedy, [None] * B, S)
        acc = tree_mod.accept_sampling(t1, lg, params, [q.generator() for q in params], 2)
    finally:
        tree_mod.kernel_available = saved
    first = torch.where(acc.n_accepted > 0, tok1[0][acc.path[:, 1]], acc.bonus)
    return {"greedy_equal": equal(TreeAccept(*_fields(torch_path)), TreeAccept(*_fields(kernel_path))),
            "greedy_rows_equal": equal(TreeAccept(*_fields(torch_path)), TreeAccept(*_fields(greedy_rows))),
            "reaches": int(torch_path.n_accepted.max()),
            "chi_square": (logits_to_probs(lg[0, 0], 1.0).tolist(),
                           torch.bincount(first, minlength=V).tolist())}


def _worker() -> dict:
    assert os.environ.get("TRITON_INTERPRET") == "1", "run with TRITON_INTERPRET=1"
    _speed_up_interpreter()
    from eagle_infer.kernels.tree_accept import fused_accept_greedy, fused_accept_sampling

    out: dict = {}
    t0 = time.perf_counter()
    for name in KERNEL_CASES:
        c = make_case(name)
        res: dict = {}
        ref = accept_sampling_reference(c["tokens"], c["parent"], c["depth"], c["probs"], c["uniforms"])
        ker = fused_accept_sampling(c["tokens"], c["parent"], c["probs"], c["uniforms"], block_v=c["block_v"])
        res["sampling_equal"] = equal(ref, ker)
        res["sampling_detail"] = f"ref {[x.tolist() for x in ref]} kernel {[x.tolist() for x in ker]}"
        res["edge"] = check_edge(c, ker)
        res["n_accepted"] = ker.n_accepted.tolist()
        g_ref = accept_greedy_reference(c["tokens"], c["parent"], c["pred"], c["num_steps"])
        g_ker = fused_accept_greedy(c["tokens"], c["parent"], c["pred"], c["num_steps"])
        res["greedy_equal"] = equal(g_ref, g_ker)
        res["greedy_detail"] = f"ref {[x.tolist() for x in g_ref]} kernel {[x.tolist() for x in g_ker]}"
        if name != "duplicates":  # accept_greedy needs distinct siblings (draft_tree's trees have them)
            onehot = torch.nn.functional.one_hot(c["pred"], c["probs"].shape[-1]).float()
            tree_acc = accept_greedy(as_tree(c), onehot, c["num_steps"])
            res["greedy_vs_tree"] = equal(TreeAccept(*_fields(tree_acc)), g_ker)
            if name == "greedy_rows":  # sampled kernel on one-hot rows = greedy acceptance
                res["sampled_onehot_vs_tree"] = equal(
                    TreeAccept(*_fields(tree_acc)),
                    fused_accept_sampling(c["tokens"], c["parent"], onehot, c["uniforms"]))
        out[name] = res
    # The logits form of the greedy entry point (argmax taken by torch).
    c = make_case("random_b8")
    logits = torch.randn(*c["probs"].shape, generator=torch.Generator().manual_seed(3))
    out["greedy_logits_equal"] = equal(
        fused_accept_greedy(c["tokens"], c["parent"], logits, c["num_steps"]),
        accept_greedy_reference(c["tokens"], c["parent"], logits.argmax(-1), c["num_steps"]))
    out["chi_square"] = _first_token_counts(kernel=True, n=600, seed=11)
    out["dispatch"] = _tree_dispatch()
    out["seconds"] = time.perf_counter() - t0
    return out


def _compile_for_cuda() -> dict:
    """Compile both kernels to PTX and cubin for sm_80 (no GPU needed): the interpreter does not
    type-check like the compiler does. The sampled kernel must have no fused multiply-adds, or
    its rounding would differ from the reference's."""
    import re

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from eagle_infer.kernels import _tree_accept_triton as k

    ptr, out = "*i64", {}
    sig = dict(tokens_ptr=ptr, parent_ptr=ptr, pred_ptr=ptr, path_ptr=ptr, n_ptr=ptr, bonus_ptr=ptr, N="i32",
               NUM_STEPS="constexpr", BLOCK_N="constexpr")
    src = ASTSource(fn=k.accept_greedy_kernel, signature=sig, constexprs=dict(NUM_STEPS=5, BLOCK_N=16))
    out["greedy"] = sorted(triton.compile(src, target=GPUTarget("cuda", 80, 32)).asm)
    sig = dict(tokens_ptr=ptr, parent_ptr=ptr, probs_ptr="*fp32", u_ptr="*fp32", path_ptr=ptr, n_ptr=ptr,
               bonus_ptr=ptr, N="i32", V="i32", NUM_STEPS="constexpr", R="constexpr", BLOCK_N="constexpr",
               BLOCK_V="constexpr")
    src = ASTSource(fn=k.accept_sampling_kernel, signature=sig,
                    constexprs=dict(NUM_STEPS=5, R=4, BLOCK_N=16, BLOCK_V=1024))
    asm = triton.compile(src, target=GPUTarget("cuda", 80, 32)).asm
    out["sampling"] = sorted(asm)
    out["sampling_fma"] = len(re.findall(r"\bfma\.", asm["ptx"]))
    return out


# -- tests ----------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def compiled() -> dict:
    if importlib.util.find_spec("triton") is None:
        pytest.skip("triton is not installed (it installs on linux x86_64)")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(OMP_NUM_THREADS="1", TRITON_DEFAULT_FP_FUSION="1")  # the default, said aloud: no warning
    proc = subprocess.run([sys.executable, str(Path(__file__).resolve()), "--compile"], env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_kernels_compile_for_cuda(compiled):
    assert "cubin" in compiled["greedy"] and "cubin" in compiled["sampling"], compiled
    assert compiled["sampling_fma"] == 0


@pytest.fixture(scope="module")
def interpreted() -> dict:
    if importlib.util.find_spec("triton") is None:
        pytest.skip("triton is not installed (it installs on linux x86_64)")
    env = dict(os.environ, TRITON_INTERPRET="1", OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, str(Path(__file__).resolve())], env=env, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("name", KERNEL_CASES)
def test_kernel_equals_reference(interpreted, name):
    res = interpreted[name]
    assert res["sampling_equal"], res["sampling_detail"]
    assert res["greedy_equal"], res["greedy_detail"]
    assert res["edge"] is None, res["edge"]
    if "greedy_vs_tree" in res:
        assert res["greedy_vs_tree"], "greedy kernel differs from tree.accept_greedy"
    if "sampled_onehot_vs_tree" in res:
        assert res["sampled_onehot_vs_tree"], "sampled kernel on one-hot rows differs from accept_greedy"


def test_kernel_cases_cover_depths(interpreted):
    """The random cases reach beyond the root somewhere, and stop short somewhere."""
    ns = [n for name in ("chain", "random_b8", "topk_topp") for n in interpreted[name]["n_accepted"]]
    assert max(ns) >= 2 and min(ns) < max(ns), ns
    assert interpreted["greedy_logits_equal"]


def chi_square_p(p: list[float], counts: list[int]) -> float:
    exp = torch.tensor(p, dtype=torch.float64)
    obs = torch.tensor(counts, dtype=torch.float64)
    keep = exp > 0
    assert obs[~keep].sum() == 0, "emitted a token the target gives zero probability"
    exp, obs = exp[keep] * obs.sum() / exp[keep].sum(), obs[keep]
    # Merge rare cells so the chi-square approximation holds.
    order = exp.argsort()
    exp, obs = exp[order], obs[order]
    small = exp.cumsum(0) < 25
    if small.any():
        exp = torch.cat([exp[small].sum()[None], exp[~small]])
        obs = torch.cat([obs[small].sum()[None], obs[~small]])
    return float(chisquare(obs.numpy(), exp.numpy()).pvalue)


def test_kernel_sampling_is_lossless(interpreted):
    """The kernel's first emitted token follows the target's root distribution (600 rows: what
    the interpreter affords; the reference, equal to the kernel above, is tested at 40k)."""
    p, counts = interpreted["chi_square"]
    assert chi_square_p(p, counts) > 0.01, counts


def test_tree_dispatches_to_the_kernels(interpreted):
    """tree.py's CUDA branch, forced on the interpreter: same acceptance as its torch path, and
    sampling through it stays lossless."""
    d = interpreted["dispatch"]
    assert d["reaches"] >= 2
    assert d["greedy_equal"] and d["greedy_rows_equal"]
    assert chi_square_p(*d["chi_square"]) > 0.01, d["chi_square"]


def test_reference_sampling_is_lossless():
    p, counts = _first_token_counts(kernel=False, n=40_000, seed=12)
    assert chi_square_p(p, counts) > 0.01, counts
    # The test has power: moving 0.08 of mass between two tokens is rejected.
    wrong = list(p)
    wrong[2], wrong[6] = wrong[2] * 0.6, wrong[6] + wrong[2] * 0.4
    assert chi_square_p(wrong, counts) < 1e-6


@pytest.mark.parametrize("settings", [dict(temperature=1.0), dict(temperature=0.7, top_p=0.8),
                                      dict(temperature=1.2, top_k=6)], ids=["t1", "topp", "topk"])
def test_reference_sampling_second_token_is_lossless(settings):
    """Depth 2: given the first emitted token is a drafted child c, the second emitted token
    (c's accepted child, or the bonus drawn at c) follows the target's distribution at c."""
    g = torch.Generator().manual_seed(7)
    V, n = 10, 30_000
    tokens, parent, depth = random_tree(g, 1, 7, 2, V, max_kids=3)
    logits = boosted_logits(g, tokens, parent, V, 1.5)
    probs = logits_to_probs(logits, **settings).expand(n, -1, -1).contiguous()
    u = torch.rand(n, 3, 4, generator=g)
    acc = accept_sampling_reference(tokens.expand(n, -1), parent.expand(n, -1), depth.expand(n, -1), probs, u)
    on = acc.n_accepted >= 1
    c = int(torch.mode(acc.path[on, 1]).values)  # the most often accepted first child
    rows = on & (acc.path[:, 1] == c)
    second = torch.where(acc.n_accepted[rows] >= 2, tokens[0][acc.path[rows, 2]], acc.bonus[rows])
    assert rows.sum() > 2000
    assert chi_square_p(probs[0, c].tolist(), torch.bincount(second, minlength=V).tolist()) > 0.01


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available() or importlib.util.find_spec("triton") is None,
                    reason="needs CUDA and triton")
@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1", reason="compiled kernels only")
def test_kernels_on_cuda_equal_reference():
    """On a GPU: the compiled kernels equal the torch reference run on the same CUDA tensors
    (the reference's CUDA cumsum and the kernel's scans must still agree: integer masses)."""
    from eagle_infer.kernels.tree_accept import fused_accept_greedy, fused_accept_sampling

    assert kernel_available(torch.zeros(1, device="cuda"))
    for name in KERNEL_CASES:
        c = {k: v.cuda() if isinstance(v, torch.Tensor) else v for k, v in make_case(name).items()}
        ref = accept_sampling_reference(c["tokens"], c["parent"], c["depth"], c["probs"], c["uniforms"])
        ker = fused_accept_sampling(c["tokens"], c["parent"], c["probs"], c["uniforms"], block_v=c["block_v"])
        assert equal(ref, ker), name
        g_ref = accept_greedy_reference(c["tokens"], c["parent"], c["pred"], c["num_steps"])
        assert equal(g_ref, fused_accept_greedy(c["tokens"], c["parent"], c["pred"], c["num_steps"])), name
    # A real vocabulary, several tiles, many rows.
    g = torch.Generator().manual_seed(5)
    B, N, S, V = 64, 16, 5, 49152
    tokens, parent, depth = random_tree(g, B, N, S, V, max_kids=4)
    probs = logits_to_probs(boosted_logits(g, tokens, parent, V, 12.0), 0.8, 0.95)
    u = torch.rand(B, S + 1, N, generator=g)
    args = [t.cuda() for t in (tokens, parent, depth, probs, u)]
    assert equal(accept_sampling_reference(*args), fused_accept_sampling(args[0], args[1], args[3], args[4]))


def test_kernel_only_dispatched_on_cuda():
    assert not kernel_available(torch.zeros(2, 3))


def test_reference_greedy_equals_accept_greedy():
    g = torch.Generator().manual_seed(1)
    for B, N, S, kids in ((16, 4, 3, 4), (16, 16, 5, 4), (8, 16, 2, 15)):
        tokens, parent, depth = random_tree(g, B, N, S, 50, max_kids=kids)
        pred = greedy_pred(g, tokens, parent, 50, match=0.85)
        logits = torch.nn.functional.one_hot(pred, 50).float()
        tree_acc = accept_greedy(DraftTree(tokens, parent, depth, ancestor_mask(parent, S)), logits, S)
        ref = accept_greedy_reference(tokens, parent, pred, S)
        assert equal(ref, TreeAccept(*_fields(tree_acc)))
        assert ref.n_accepted.max() >= 2
        # Sampled acceptance on one-hot rows is greedy acceptance.
        u = torch.rand(B, S + 1, N, generator=g)
        assert equal(accept_sampling_reference(tokens, parent, depth, logits, u), ref)


@pytest.mark.parametrize("name", KERNEL_CASES)
def test_reference_cases_hit_their_edges(name):
    c = make_case(name)
    acc = accept_sampling_reference(c["tokens"], c["parent"], c["depth"], c["probs"], c["uniforms"])
    assert check_edge(c, acc) is None


if __name__ == "__main__":
    print(json.dumps(_compile_for_cuda() if sys.argv[1:] == ["--compile"] else _worker()))
