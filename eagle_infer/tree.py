"""The draft tree: EAGLE-2 dynamic expansion, the verify-side mask, and acceptance walks.

Vocabulary (SGLang's names):
    num_steps         draft forwards per round = the tree's depth
    eagle_topk        children kept per expanded node, and frontier width (1 = chain drafting)
    num_draft_tokens  nodes the target verifies, the root included
    ngram_branch      the longest prompt-lookup chain offered to the tree (0 = none): what
                      followed the latest earlier occurrence of the sequence's last tokens
                      (`ngram_lookup`), its nodes scored by how often such a match was right

One round, for a batch of B sequences whose first L[b] tokens are committed and whose next
token (the root, already sampled by the target) is not yet verified:
  1. `draft_tree` expands the frontier `num_steps` times from the draft's distribution after
     the root, scores every child by cumulative log-probability, and keeps the best
     `num_draft_tokens - 1` candidates (parents always score >= children, so they form a tree);
     with `ngram_branch`, the lookup's chain competes for those places as a branch of the root.
  2. The target scores root + nodes in one forward with `DraftTree.mask` (a node sees the
     committed prefix and its ancestors) at positions L + depth.
  3. `accept_greedy` / `accept_sampling` walk from the root and return the accepted path and
     the bonus token sampled from the target.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from eagle_infer.errors import UserError
from eagle_infer.kernels.tree_accept import fused_accept_greedy, fused_accept_sampling, kernel_available
from eagle_infer.model import build_attn_mask
from eagle_infer.sampling import (
    SamplingParams,
    greedy_tokens,
    inverse_cdf,
    logits_to_probs,
    masked_greedy_tokens,
)


@dataclass(frozen=True)
class TreeConfig:
    num_steps: int = 5
    eagle_topk: int = 4
    num_draft_tokens: int = 16
    ngram_branch: int = 0

    def __post_init__(self) -> None:
        if self.num_steps < 1 or self.eagle_topk < 1 or self.num_draft_tokens < 2 or self.ngram_branch < 0:
            raise UserError(f"tree settings must be num_steps >= 1, eagle_topk >= 1, num_draft_tokens >= 2, "
                            f"ngram_branch >= 0; got {self}")
        if self.num_draft_tokens - 1 > self.max_candidates:
            raise UserError(
                f"num_draft_tokens={self.num_draft_tokens} is more than the tree can hold: "
                f"{self.num_steps} steps of top-{self.eagle_topk} give {self.max_candidates} candidates "
                f"(+1 root)"
            )

    @property
    def max_depth(self) -> int:
        """The deepest node a tree can hold: num_steps (or the n-gram branch's length where that
        is longer), at most num_draft_tokens - 1; an accepted path is at most this long (catch-up
        pairs: the path + the bonus)."""
        return min(max(self.num_steps, self.ngram_branch), self.num_draft_tokens - 1)

    @property
    def slots_past_end(self) -> int:
        """Cache slots a round writes past a sequence's committed tokens: the verify's nodes and
        a draft phase's frontiers (the room a sequence keeps free at its end)."""
        return self.num_draft_tokens + self.eagle_topk * self.num_steps

    def label(self) -> str:
        """num_steps/eagle_topk/num_draft_tokens, "+gK" with an n-gram branch of K."""
        base = f"{self.num_steps}/{self.eagle_topk}/{self.num_draft_tokens}"
        return base + (f"+g{self.ngram_branch}" if self.ngram_branch else "")

    @property
    def max_candidates(self) -> int:
        k = self.eagle_topk
        return k + (self.num_steps - 1) * k * k

    @classmethod
    def chain(cls, num_steps: int) -> TreeConfig:
        return cls(num_steps=num_steps, eagle_topk=1, num_draft_tokens=num_steps + 1)

    @classmethod
    def from_label(cls, text: str) -> TreeConfig:
        """The tree a label names (label()): "2/4/6", or "2/4/6+g4" with an n-gram branch of 4."""
        base, _, ngram = text.strip().partition("+g")
        parts = base.split("/")
        try:
            if len(parts) != 3:
                raise ValueError
            return cls(*map(int, parts), ngram_branch=int(ngram) if ngram else 0)
        except ValueError:
            raise UserError(f"a tree is STEPS/TOPK/DRAFT_TOKENS with an optional +gK (n-gram branch), "
                            f"e.g. 1/4/3+g4; got {text!r}") from None

    @classmethod
    def parse_batch_tree(cls, text: str) -> tuple[int, TreeConfig]:
        """--speculative-batch-tree MIN_BATCH:TREE, e.g. "3:1/4/3+g4": from MIN_BATCH running
        sequences on, rounds draft and verify TREE (SpecDecoder's batch_tree)."""
        at, sep, label = text.partition(":")
        if not sep or not at.strip().isdigit() or int(at) < 2:
            raise UserError(f"a batch tree is MIN_BATCH:TREE with MIN_BATCH >= 2, e.g. 3:1/4/3+g4; "
                            f"got {text!r}")
        return int(at), cls.from_label(label)

    @classmethod
    def batch_tree_for(cls, given: str | None, device_type: str, quantization: str = "none",
                       dtype: str = "fp32") -> tuple[int, TreeConfig] | None:
        """--speculative-batch-tree: MIN_BATCH:TREE, "none", or where not given (None) the
        device's default (SpecDecoder's batch_tree). On a CPU whose bf16 kernel multiplies on AMX
        tiles (bf16 activations, int8 weights too), 1/4/3+g4 from 3 sequences, from 2 with int8
        weights: at batch 4 the main tree (2/4/6+g4 then) verifies 28 rows (two row blocks on the tiles),
        1/4/3+g4 16. docs/measurements.md "A tree that shrinks as the batch grows" (8 MT-bench prompts,
        interleaved, against rounds without drafts, the default before): bf16 batch 4 1.15x plain
        against 0.90x (eager 1.02x against 0.96x), batch 2 level with 2/4/6+g4; int8 batch 4
        0.99x against 0.74x, batch 2 1.08x against 0.94x. Where it multiplies on vdpbf16ps (AMD
        CPUs with AVX512-BF16), bf16 weights only, 1/4/2+g4 from 3 sequences: its 12 rows at batch
        4 run the chunked tiles, whose lead streams the weights into L2 (docs/measurements.md "Batch
        trees on vdpbf16ps": Zen 4, 8 MT-bench prompts, three runs each against rounds without
        drafts, the default before: 1.03-1.10x plain against 0.95-0.98x; 1/4/3+g4 0.94-1.07x).
        Elsewhere none (an AVX2 Zen 2's FMA loops ran 1/4/2+g4 at 0.83x, 1/4/3+g4 at 0.73x)."""
        if given is not None:
            return None if given.strip().lower() == "none" else cls.parse_batch_tree(given)
        if device_type != "cpu" or dtype != "bf16":
            return None
        from eagle_infer.kernels.bf16_linear import multiply_default

        multiply = multiply_default()
        if multiply == "vdpbf16ps" and quantization != "int8":
            return 3, cls(1, 4, 2, ngram_branch=4)
        if multiply != "amx":
            return None
        return (2 if quantization == "int8" else 3), cls(1, 4, 3, ngram_branch=4)

    @classmethod
    def default_for(cls, device_type: str, quantization: str = "none", dtype: str = "fp32") -> TreeConfig:
        """The tree a server uses when no tree flag is given. On a GPU verifying 16 nodes costs
        about what verifying one does: 5/4/16. On a CPU verify cost grows with every node, so a
        small tree wins (docs/measurements.md: bf16 sweep on a 2-core CPU, 3/4/4 1.13x plain,
        5/4/16 0.99x), and
        of 4 nodes a third draft step rarely places one (τ 1.773 at 2/4/4, 1.791 at 3/4/4) but
        costs 0.08-0.12 plain steps: 2/4/4 in fp32 (AMD EPYC, AVX2). In bf16 on our kernel, with
        the draft phase inside the round (draft ahead) and the segment-16 head, two more nodes
        paid: 2/4/6 ahead of 2/4/4 in 6 of 6 interleaved rounds on a Zen 4 (+0.8 to +6.2%, τ 1.80
        / 1.89 against 1.69 / 1.76; 2/4/8 behind). With int8 weights a step is short and the draft
        forward is not (~1.1 ms of an ~8 ms round): one draft step, the root's top 3, 1/4/3 (Zen 4,
        10 MT-bench prompts, scripts/ab_cpu_linears.py --also-trees: 186 against 171 tokens/s,
        ahead in 3 of 3 rounds, 1.12x plain against 1.03x at τ 1.50 against 1.67; three runs
        interleaved by prompt agreed, 1.10-1.13x against 1.00-1.05x; with draft ahead still
        ahead of 2/4/4).

        On a CPU each tree also takes an n-gram branch of 4 (6 in bf16 on AMX, below; prompt
        lookup competing for the same places: no more rows verified). Zen 4, 2 of each MT-bench
        category (16 prompts), interleaved: bf16 2/4/6+g4 146.8 tokens/s against 2/4/6 128.9 (τ
        2.135 against 1.836; 2/4/4+g4 137.1, 1/4/3+g4 130.9); int8 1/4/3+g4 232.8 against 1/4/3
        208.9 (τ 1.742 against 1.529; 2/4/4+g4 225.3). A GPU keeps none until measured there.
        Again on the Zen 4 with the shipped head (τ 2.21, 16 prompts, 2 rounds,
        results/ab_trees_ngram6_bf16_zen4.json): 2/4/6+g6 level with 2/4/6+g4 (169.0 / 163.3
        against 169.0 / 161.3 tokens/s, 1.70x plain), 2/4/8 behind with either branch (157-164).

        On a CPU with AMX (the bf16 kernel on the tiles) bigger trees raise τ but the draft steps
        and attention still grow with them: 2/4/6+g4 was level with 2/4/8+g4, 2/4/10+g4 and
        3/4/8+g4 and ahead of 4/4/12+g4 and 5/4/16+g4 in bf16 while a verify's rows ran one
        32-column panel at a time. Since they run two (up to 16 rows), 2/4/8+g4 in bf16: 16
        MT-bench prompts (2 a category), interleaved prompt by prompt, two runs of 2 rounds,
        +2.0 to +3.0% over 2/4/6+g4 in 4 of 4 rounds (177.7 / 179.4 against 172.4 / 175.8
        tokens/s, τ 2.326 against 2.22), 2/4/10+g4 level (178.5 / 178.7), 2/4/12+g4 and
        3/4/10+g4 between (docs/measurements.md "A verify's Linears on AMX two panels at a
        time"). Its n-gram branch is 6 long: of 8 places a longer lookup chain wins more often,
        +1.1 to +3.4% in 4 of 4 interleaved rounds on the same 16 prompts (either order; τ
        2.359 against 2.326) and +3.9% on 8 long prompts (118.2 against 113.8 tokens/s, τ
        3.771 against 3.317). With int8 weights (one panel at a time) 2/4/6+g4: 16 prompts, 2
        rounds, 160.4 tokens/s against 145.9 for 1/4/3+g4 (τ 2.291 against 1.795; 2/4/4+g4
        147.1), and again after the bf16 change 286 against 283 for 2/4/8+g4 and 279 for
        2/4/10+g4 (g6 level with g4 there). The multiply is known before the model loads
        ($EAGLE_BF16_DOT, else the CPU: bf16_linear.multiply_default).

        On an AVX2 CPU without AVX512-BF16 (the bf16 kernel's AVX2 build), since its tiles take k
        in chunks (a verify's Linears at 4 / 6 / 8 rows 1.11 / 1.21 / 1.57x a one-row step's),
        1/4/4+g4. AMD EPYC Zen 2, 16 MT-bench prompts (2 a category), 2 rounds interleaved,
        results/ab_trees_bf16_amd_avx2_chunks16.json: 87.9 tokens/s (1.31x plain, τ 1.91)
        against 87.5 for 2/2/4+g4, 86.6 for 2/4/4+g4, 85.8 for 1/4/3+g4 (the default before, τ
        1.76) and 78.4 for 1/4/5+g4, in that order in both rounds; with 8 prompts 2/4/4+g4 93.8,
        1/4/3+g4 92.5, 2/4/5+g4 88.3, 2/4/6+g4 86.8 (τ 2.28), 2/4/8+g4 74.2
        (results/ab_trees_bf16_amd_avx2_chunks.json). With int8 weights each tile converts the
        weights again (compute-bound from 3 rows): 1/4/2+g4, 1.08x plain against 1.00x for
        1/4/3+g4 and 0.89x for 2/4/4+g4 (results/ab_trees_int8_amd_avx2_chunks.json; the same
        order before the chunks: results/ab_trees_int8_amd_avx2_madd.json).

        On AMD Zen 1 (AVX2 on 128-bit FMA units: bf16_linear.fma_halves) every row past the first
        costs more (the lm_head at 2 / 3 / 4 rows 1.09 / 1.30 / 1.78x one row), so 1/4/2+g4 in
        bf16 too: 16 MT-bench prompts, 2 rounds interleaved, 70.1 tokens/s (1.15x plain, τ 1.53)
        against 68.0 for 1/4/3+g4, 66.7 for 2/1/3+g4 and 2/2/3+g4, 58.2 (0.95x) for 1/4/4+g4,
        in that order in both rounds (results/ab_trees_bf16_amd_zen1.json); 1/1/2+g4 level, the
        n-gram branch +5% (results/ab_two_row_trees_bf16_amd_zen1.json)."""
        if device_type != "cpu":
            return cls()
        from eagle_infer.kernels.bf16_linear import avx512_bf16_supported, fma_halves, multiply_default

        if not avx512_bf16_supported():
            kernel = "avx2_128" if fma_halves() else "avx2"
        else:  # known before the model loads; fp32 never asks (a bad $EAGLE_BF16_DOT stays quiet)
            kernel = multiply_default() if dtype == "bf16" else "fma"
        return cls.cpu_default(dtype, quantization, kernel)

    @classmethod
    def cpu_default(cls, dtype: str, quantization: str, kernel: str) -> TreeConfig:
        """The CPU's default tree for a dtype, weights ("none" or "int8") and the bf16 kernel that
        runs a verify's Linears: "avx2" (its AVX2 build, a CPU without AVX512-BF16), "avx2_128"
        (the same on 128-bit FMA units: AMD Zen 1), else what it multiplies on ("fma",
        "vdpbf16ps", "amx"). default_for finds the kernel and says why each."""
        g4 = {"ngram_branch": 4}
        two_rows = cls(1, 4, 2, **g4)
        if quantization == "int8":
            if dtype != "bf16":  # fp32 activations: int8 weights run torch's kernel
                return cls(1, 4, 3, **g4)
            return {"avx2": two_rows, "avx2_128": two_rows, "amx": cls(2, 4, 6, **g4)}.get(
                kernel, cls(1, 4, 3, **g4))
        if dtype == "bf16":
            by_kernel = {"avx2": cls(1, 4, 4, **g4), "avx2_128": two_rows,
                         "amx": cls(2, 4, 8, ngram_branch=6)}
            return by_kernel.get(kernel, cls(2, 4, 6, **g4))
        return cls(2, 4, 4, **g4)

    @classmethod
    def cpu_defaults_text(cls) -> str:
        """cpu_default's trees in a line, for --help texts."""
        def trees(dtype: str, quantization: str) -> str:
            base = previous = cls.cpu_default(dtype, quantization, "fma").label()
            others = []
            for kernel, where in (("amx", "on AMX"), ("avx2", "on AVX2 only"), ("avx2_128", "on AMD Zen 1")):
                label = cls.cpu_default(dtype, quantization, kernel).label()
                if label not in (base, previous):  # Zen 1's only where it is not AVX2's
                    others.append(f"{label} {where}")
                previous = label
            return base + (f" ({', '.join(others)})" if others else "")

        return (f"on a CPU bf16 {trees('bf16', 'none')}, fp32 {trees('fp32', 'none')}, "
                f"int8 weights in bf16 {trees('bf16', 'int8')}")

    @classmethod
    def from_flags(cls, num_steps: int | None, eagle_topk: int | None, num_draft_tokens: int | None,
                   device_type: str, quantization: str = "none", dtype: str = "fp32",
                   ngram_branch: int | None = None) -> TreeConfig:
        """The tree flags given (None = not given), the device's default (default_for) for the
        others: what the server, the bench and the pipeline's bench run."""
        base = cls.default_for(device_type, quantization, dtype)
        given = (num_steps, eagle_topk, num_draft_tokens, ngram_branch)
        return cls(*(g if g is not None else d for g, d in zip(
            given, (base.num_steps, base.eagle_topk, base.num_draft_tokens, base.ngram_branch))))


@dataclass
class DraftTree:
    tokens: Tensor  # [B, N] target ids; node 0 is the root
    parent: Tensor  # [B, N] parent node index (the root is its own parent)
    depth: Tensor  # [B, N] 0 for the root
    mask: Tensor  # [B, N, N] bool: node i sees node j iff j is i or one of its ancestors


# The longest run of latest tokens ngram_lookup matches (it tries this many, then fewer).
NGRAM_MAX = 4


def ngram_lookup(history: Tensor, end: Tensor, length: int,
                 max_ngram: int = NGRAM_MAX) -> tuple[Tensor, Tensor]:
    """Prompt lookup (vLLM's ngram drafter, on-device): each row's `length` next tokens guessed
    as what followed the latest earlier occurrence of its last n tokens, the longest n <= max_ngram
    that occurs (down to 1). history [B, S]: each row's tokens (prompt and output) at 0..end[b],
    the last one the root; what lies past end is never read. A match p tokens back continues
    periodically past the known end (token i = the one p - i % p tokens back), so a loop of any
    period is proposed whole. Returns the tokens [B, length] and the length n of each row's
    match [B] (0: none, its root seen nowhere before; its tokens are then the root repeated)."""
    B, S = history.shape
    dev = history.device
    start = torch.arange(S, device=dev)[None]  # [1, S] candidate window starts
    # Padded so that every window slices S columns whatever S is (S is the traced kv length in a
    # compiled round: a slice of S - n + 1 would add a guard S >= n); windows past end never count.
    padded = torch.cat([history, history.new_zeros(B, max_ngram)], 1)
    best = torch.full((B,), -1, dtype=torch.long, device=dev)
    best_n = torch.zeros(B, dtype=torch.long, device=dev)
    for n in range(max_ngram, 0, -1):
        suffix = torch.gather(history, 1, (end[:, None] - n + 1 + torch.arange(n, device=dev)).clamp(min=0))
        hit = start <= (end - n)[:, None]  # window j ends before the suffix's last token
        for i in range(n):  # and matches: history[j + i] == suffix[i] for every i
            hit &= padded[:, i:i + S] == suffix[:, i:i + 1]
        latest = torch.where(hit, start, -1).amax(-1)
        take = (best < 0) & (latest >= 0)
        best, best_n = torch.where(take, latest, best), torch.where(take, n, best_n)
    period = (end + 1 - best_n - best).clamp(min=1)  # the match's distance back (found rows)
    steps = torch.arange(length, device=dev)[None]
    idx = torch.where((best >= 0)[:, None], best[:, None] + best_n[:, None] + steps % period[:, None],
                      end[:, None])
    return torch.gather(history, 1, idx.clamp(max=S - 1)), best_n


# How often a lookup's token was right, by the match's length n (rows 1-4) and the token's place
# in the chain (columns), given the ones before it were: SmolLM2-135M-Instruct's greedy answers
# (bf16, up to 256 tokens) to 64 prompts it wrote itself, not the bench's MT-bench ones
# (13,667 answer tokens; `python scripts/calibrate_ngram.py`, results/ngram_hit_rate.json).
# A chain's candidates score the sum of these logs, as the draft's the sum of its log-probs.
NGRAM_HIT_RATE = ((0.21, 0.59, 0.74, 0.77), (0.56, 0.7, 0.76, 0.74), (0.7, 0.75, 0.73, 0.77),
                  (0.88, 0.9, 0.92, 0.93))


def ancestor_mask(parent: Tensor, max_depth: int) -> Tensor:
    """[B, N] parent pointers -> [B, N, N] ancestor-or-self mask."""
    B, N = parent.shape
    eye = torch.eye(N, dtype=torch.bool, device=parent.device).expand(B, N, N)
    mask = eye
    for _ in range(max_depth):
        mask = eye | torch.gather(mask, 1, parent[:, :, None].expand(B, N, N))
    return mask


# Runs the draft head on a frontier; see `draft_tree`. (tokens, feature, positions, mask, slots)
# -> (logits [B, K, V'], g [B, K, h]).
DraftStep = Callable[[Tensor, Tensor, Tensor, Tensor, Tensor], tuple[Tensor, Tensor]]


@torch.no_grad()
def draft_tree(
    cfg: TreeConfig,
    step: DraftStep,
    root: Tensor,  # [B] root token ids
    root_logp: Tensor,  # [B, V'] draft log-probs for the token after the root
    root_g: Tensor,  # [B, h] the draft's output feature at the root
    prefix_len: Tensor,  # [B] committed tokens (= draft cache entries) per sequence
    kv_len: int,
    draft_to_target: Tensor | None,  # [V'] target ids of draft ids, None = identity
    history: Tensor | None = None,  # [B, S] tokens so far, the root at prefix_len (ngram_branch)
) -> DraftTree:
    """Grow the EAGLE-2 tree: `num_steps - 1` draft forwards over a frontier of `eagle_topk`
    nodes; the frontier's nodes are written to the draft cache after the prefix, at
    slot offsets (depth - 1) * topk + j. With cfg.ngram_branch, the lookup's chain from
    `history` follows the draft's nodes."""
    B, K, dev = root.shape[0], cfg.eagle_topk, root.device
    to_target = (lambda ids: ids) if draft_to_target is None else (lambda ids: draft_to_target[ids])
    arK = torch.arange(K, device=dev)

    f_scores, f_ids = root_logp.float().topk(K, dim=-1)  # [B, K]
    f_tokens = to_target(f_ids)
    scores, tokens = [f_scores], [f_tokens]
    parents = [torch.full((B, K), -1, device=dev, dtype=torch.long)]  # -1 = the root
    depths = [torch.ones(B, K, device=dev, dtype=torch.long)]
    f_index = arK.expand(B, K)  # candidate index of each frontier node
    # Contiguous like the gathered frontiers after it: a compiled step guards on strides, and an
    # expanded view here compiled a second graph per batch bucket.
    f_feat = root_g[:, None, :].expand(B, K, root_g.shape[-1]).contiguous()
    anc = torch.eye(K, dtype=torch.bool, device=dev).expand(B, K, K)  # frontier rows over the window
    next_index = K
    for d in range(1, cfg.num_steps):  # feed the depth-d frontier
        slots = prefix_len[:, None] + (d - 1) * K + arK
        pos = (prefix_len + d - 1)[:, None].expand(B, K)
        mask = build_attn_mask(prefix_len, anc, kv_len)
        logits, g = step(f_tokens, f_feat, pos, mask, slots)
        child_lp, child_ids = torch.log_softmax(logits.float(), -1).topk(K, dim=-1)  # [B, K, K]
        c_scores = (f_scores[:, :, None] + child_lp).reshape(B, K * K)
        c_tokens = to_target(child_ids).reshape(B, K * K)
        scores.append(c_scores)
        tokens.append(c_tokens)
        parents.append(f_index[:, :, None].expand(B, K, K).reshape(B, K * K))
        depths.append(torch.full((B, K * K), d + 1, device=dev, dtype=torch.long))
        if d == cfg.num_steps - 1:
            break
        f_scores, pick = c_scores.topk(K, dim=-1)  # next frontier: best K children
        par = pick // K
        f_index = next_index + pick
        f_tokens = torch.gather(c_tokens, 1, pick)
        f_feat = torch.gather(g, 1, par[:, :, None].expand(B, K, g.shape[-1]))
        W = anc.shape[-1]
        grown = torch.zeros(B, K, W + K, dtype=torch.bool, device=dev)
        grown[:, :, :W] = torch.gather(anc, 1, par[:, :, None].expand(B, K, W))
        grown[:, arK, W + arK] = True
        anc = grown
        next_index += K * K

    if cfg.ngram_branch:
        if history is None:
            raise ValueError("draft_tree: an ngram_branch needs the sequences' history")
        ngram_candidates(cfg.ngram_branch, history, prefix_len, scores, tokens, parents, depths)
    all_scores, all_tokens = torch.cat(scores, 1), torch.cat(tokens, 1)
    all_parents, all_depths = torch.cat(parents, 1), torch.cat(depths, 1)
    C, N = all_scores.shape[1], cfg.num_draft_tokens
    # Ties go to the earlier candidate, so a parent (always earlier) is kept before its child.
    key = all_scores.double() - 1e-9 * torch.arange(C, device=dev, dtype=torch.double)
    chosen = key.topk(N - 1, dim=-1).indices.sort(dim=-1).values  # [B, N-1]
    node_of = torch.zeros(B, C + 1, dtype=torch.long, device=dev)  # candidate+1 -> node (0 = root)
    node_of.scatter_(1, chosen + 1, torch.arange(1, N, device=dev).expand(B, N - 1))
    zero = torch.zeros(B, 1, dtype=torch.long, device=dev)
    parent = torch.cat([zero, torch.gather(node_of, 1, torch.gather(all_parents, 1, chosen) + 1)], 1)
    depth = torch.cat([zero, torch.gather(all_depths, 1, chosen)], 1)
    tree_tokens = torch.cat([root[:, None], torch.gather(all_tokens, 1, chosen)], 1)
    return DraftTree(tree_tokens, parent, depth, ancestor_mask(parent, cfg.max_depth))


def ngram_candidates(length: int, history: Tensor, prefix_len: Tensor, scores: list[Tensor],
                     tokens: list[Tensor], parents: list[Tensor], depths: list[Tensor]) -> None:
    """Add the lookup's chain (ngram_lookup from the root at prefix_len) to draft_tree's candidate
    lists as a branch of the root, scored by NGRAM_HIT_RATE. Where its first token is one of the
    draft's depth-1 candidates (the lists' first entries, tokens[0]), the chain continues under that
    one, whose score rises to the chain's if lower (so the parent still scores >= its child),
    instead of a second node of the same token; rows without a match offer nothing (score -1e4,
    never chosen over the draft's). Appends to the lists in place."""
    B, dev = prefix_len.shape[0], prefix_len.device
    chain, n = ngram_lookup(history, prefix_len, length)  # [B, length], [B]
    rates = torch.tensor(NGRAM_HIT_RATE, device=dev).log()  # [4, 4]
    place = torch.arange(length, device=dev).clamp(max=rates.shape[1] - 1)
    ch_scores = rates[(n - 1).clamp(min=0)][:, place].cumsum(-1)  # [B, length]
    ch_scores = torch.where((n > 0)[:, None], ch_scores, -1e4)
    same = tokens[0] == chain[:, :1]  # [B, K]: the draft's depth-1 node of the chain's first token
    merged = same.any(-1)
    scores[0] = torch.where(same, torch.maximum(scores[0], ch_scores[:, :1]), scores[0])
    first = sum(s.shape[1] for s in scores)  # the chain's first candidate index
    idx = torch.arange(length, device=dev)
    parent = (first + idx - 1).expand(B, length).clone()
    parent[:, 0] = -1
    parent[:, 1:2] = torch.where(merged[:, None], same.float().argmax(-1, keepdim=True), parent[:, 1:2])
    scores.append(torch.cat([torch.where(merged, -1e4, ch_scores[:, 0])[:, None], ch_scores[:, 1:]], 1))
    tokens.append(chain)
    parents.append(parent)
    depths.append((idx + 1).expand(B, length))


def graft_chains(tree: DraftTree, chains: dict[int, list[int]], max_depth: int) -> DraftTree:
    """The tree with chains[b], tokens known to follow row b's root (what its grammar forces),
    as row b's first branch: nodes 1..k (k <= max_depth), then the drafted nodes below its end
    (drafted along the same tokens), then the other drafted nodes, parents before children, as
    many as the row holds; a drafted node of the chain's own tokens becomes the chain's node.
    Other rows are kept. On the host: a round's tree is a few nodes a row."""
    tokens, parent, depth = (t.clone() for t in (tree.tokens, tree.parent, tree.depth))
    N = tokens.shape[1]
    for b, chain in chains.items():
        chain = chain[:min(max_depth, N - 1)]
        k = len(chain)
        drafted, up = tokens[b].tolist(), parent[b].tolist()
        new_tokens, new_parent, new_depth = drafted[:1] + chain, [0, *range(k)], list(range(k + 1))
        where = {0: 0}  # drafted node -> its node in the new tree (the chain's are 0..k)
        for i in range(1, N):
            p = where.get(up[i])
            if p is not None and p < k and drafted[i] == chain[p]:
                where[i] = p + 1
        for below_chain in (True, False):
            for i in range(1, N):
                p = where.get(up[i])
                if i in where or p is None or (below_chain and p < k) or len(new_tokens) == N:
                    continue
                where[i] = len(new_tokens)
                new_tokens.append(drafted[i])
                new_parent.append(p)
                new_depth.append(new_depth[p] + 1)
        tokens[b], parent[b], depth[b] = (torch.tensor(v) for v in (new_tokens, new_parent, new_depth))
    return DraftTree(tokens, parent, depth, ancestor_mask(parent, max_depth))


@dataclass
class Acceptance:
    path: Tensor  # [B, max_depth + 1] accepted node indices from the root, padded with the last
    n_accepted: Tensor  # [B] accepted draft tokens (the root not counted)
    bonus: Tensor  # [B] the target's next token after the accepted path


def _path_from_leaf(tree: DraftTree, leaf: Tensor, max_depth: int) -> Tensor:
    """Node indices root..leaf ordered by depth, padded with the leaf: [B, max_depth + 1]."""
    B, N = tree.tokens.shape
    on_path = torch.gather(tree.mask, 1, leaf[:, None, None].expand(B, 1, N))[:, 0]  # [B, N]
    dump = max_depth + 1
    where = torch.where(on_path, tree.depth, torch.full_like(tree.depth, dump))
    path = torch.zeros(B, dump + 1, dtype=torch.long, device=leaf.device)
    path.scatter_(1, where, torch.arange(N, device=leaf.device).expand(B, N))
    path = path[:, :dump]
    n = torch.gather(tree.depth, 1, leaf[:, None])
    steps = torch.arange(dump, device=leaf.device)[None]
    return torch.where(steps <= n, path, leaf[:, None])


def accept_greedy(tree: DraftTree, target_logits: Tensor, max_depth: int,
                  bitmask: Tensor | None = None) -> Acceptance:
    """Longest root path whose every token equals the target's argmax after its parent (among
    the tokens a grammar's bitmask [B, N, ceil(V / 32)] allows after each node, where given)."""
    # [B, N] the target's choice after each node
    pred = greedy_tokens(target_logits) if bitmask is None else masked_greedy_tokens(target_logits, bitmask)
    if kernel_available(pred):  # CUDA: the walk in one Triton launch (eagle_infer/kernels)
        return Acceptance(*fused_accept_greedy(tree.tokens, tree.parent, pred, max_depth))
    ok = tree.tokens == torch.gather(pred, 1, tree.parent)
    ok[:, 0] = True
    on_good_path = ~(tree.mask & ~ok[:, None, :]).any(-1)  # every ancestor-or-self ok
    # The draft's siblings hold distinct tokens, so its good nodes form one chain; an n-gram
    # branch may repeat one of its tokens and form a second: the deepest good node wins.
    leaf = torch.where(on_good_path, tree.depth, -1).argmax(-1)
    n = torch.gather(tree.depth, 1, leaf[:, None])[:, 0]
    return Acceptance(_path_from_leaf(tree, leaf, max_depth), n, torch.gather(pred, 1, leaf[:, None])[:, 0])


def accept_sampling(tree: DraftTree, target_logits: Tensor, params: Sequence[SamplingParams],
                    generators: Sequence[torch.Generator | None], max_depth: int) -> Acceptance:
    """Lossless multi-draft rejection sampling (SpecInfer / EAGLE) with deterministic drafts:
    the target's distributions (sampling_probs), each row's uniforms from its own generator
    (sampling_uniforms), then the walk (walk_sampling), which a compiled round runs in its graph.

    At a node with target distribution p, try its children in order: accept child x with
    probability p(x); on rejection set p(x) = 0 and renormalise (the residual relu(p - q) for a
    one-hot q). If every child is rejected, the bonus token is drawn from what is left. Each
    emitted token is therefore distributed exactly as p, whatever the draft proposed.
    """
    probs = sampling_probs(target_logits, params)
    u = sampling_uniforms(generators, max_depth, tree.tokens.shape[1], probs)
    return walk_sampling(tree, probs, u, max_depth)


def sampling_probs(target_logits: Tensor, params: Sequence[SamplingParams]) -> Tensor:
    """Target logits [B, N, V] -> each row's sampling distribution [B, N, V] (fp32), one
    logits_to_probs per distinct setting."""
    by_setting: dict[tuple, list[int]] = {}
    for b, p in enumerate(params):
        by_setting.setdefault(p.distribution, []).append(b)
    if len(by_setting) == 1:  # every row alike (the usual case): no gather, no scatter
        return logits_to_probs(target_logits, *next(iter(by_setting)))
    probs = torch.empty(target_logits.shape, dtype=torch.float32, device=target_logits.device)
    for setting, rows in by_setting.items():
        idx = torch.tensor(rows, device=target_logits.device)
        probs[idx] = logits_to_probs(target_logits[idx], *setting)
    return probs


def sampling_uniforms(generators: Sequence[torch.Generator | None], max_depth: int, N: int,
                      like: Tensor, fused: bool | None = None) -> Tensor:
    """The walk's uniforms, each row's from its own generator (as if sampled alone): [B,
    (max_depth + 1) * N + 1] for the torch walk (one per depth and child rank, then the bonus), [B,
    max_depth + 1, N] for the CUDA kernel (u[b, d, N - 1]: the bonus if the walk stops at d; N - 1
    children per node bound any tree). fused: whether the walk will run the kernel (default:
    kernel_available; a compiled graph traces the torch walk instead). like: a tensor on the
    walk's device. walk_sampling reads the layout."""
    dev = like.device
    if kernel_available(like) if fused is None else fused:
        return torch.stack([torch.rand(max_depth + 1, N, generator=g, device=dev) for g in generators])
    return torch.stack([torch.rand((max_depth + 1) * N + 1, generator=g, device=dev) for g in generators])


def walk_sampling(tree: DraftTree, probs: Tensor, u: Tensor, max_depth: int) -> Acceptance:
    """accept_sampling's walk over the tree given the target's distributions probs [B, N, V] and
    the uniforms u (sampling_uniforms: the kernel's layout runs the kernel, the other the torch
    walk). On-device, all rows at once, no host reads: the chain of
    tries at a node is one vector test (child r is accepted iff u_r * (1 - P_<r) < p(x_r), P_<r
    the mass of the children tried before it: the renormalised test without dividing), walked
    once per depth. Greedy rows (one-hot p) accept exactly what accept_greedy does."""
    B, N = tree.tokens.shape
    dev, V = tree.tokens.device, probs.shape[-1]
    if u.dim() == 3:  # CUDA: walk + bonus draw in one Triton launch (eagle_infer/kernels)
        return Acceptance(*fused_accept_sampling(tree.tokens, tree.parent, probs, u))
    # children[b, j, r]: node j's r-th child in node order, else N (a dummy node).
    nodes = torch.arange(N, device=dev)
    is_child = (tree.parent[:, None, :] == nodes[None, :, None]) & (nodes[None, None, :] > 0)  # [B, j, c]
    rank = is_child.cumsum(-1) - 1
    children = torch.full((B, N + 1, N), N, dtype=torch.long, device=dev)
    children[:, :N].scatter_(2, torch.where(is_child, rank, N - 1), torch.where(is_child, nodes, N))
    tokens = torch.cat([tree.tokens, torch.full((B, 1), V, dtype=torch.long, device=dev)], 1)  # dummy: V
    node = torch.zeros(B, dtype=torch.long, device=dev)
    done = torch.zeros(B, dtype=torch.bool, device=dev)
    rows = torch.arange(B, device=dev)
    earlier = torch.ones(N, N, dtype=torch.bool, device=dev).tril(-1)  # [r, s]: s < r
    for d in range(max_depth + 1):
        p = torch.cat([probs[rows, node], torch.zeros(B, 1, device=dev)], 1)  # [B, V + 1]
        kids = children[rows, node]  # [B, N]
        kid_tokens = tokens.gather(1, kids)
        # A sibling repeating an earlier sibling's token (an n-gram branch's) finds p(x) already
        # zeroed by that one's rejection: p 0, never accepted, not counted twice in the mass tried.
        repeat = ((kid_tokens[:, :, None] == kid_tokens[:, None, :]) & earlier).any(-1)
        px = torch.where(repeat, 0.0, torch.gather(p, 1, kid_tokens))  # p(x) of each child, 0 for dummies
        tried = px.cumsum(1) - px  # mass of the children tried before
        ok = (u[:, d * N:(d + 1) * N] * (1 - tried) < px) & (kids < N) & ~done[:, None]
        first = torch.where(ok.any(1), ok.float().argmax(1), -1)
        moved = first >= 0  # never at max_depth: those nodes have no children
        stop = ~done & ~moved  # stays here: the bonus is drawn from this node's residual
        resid = p.scatter(1, kid_tokens, 0.0)[:, :V]  # its tried children zeroed
        if d == 0:
            bonus_p = resid
        else:
            bonus_p = torch.where(stop[:, None], resid, bonus_p)
        node = torch.where(moved & ~done, kids.gather(1, first.clamp(min=0)[:, None])[:, 0], node)
        done = done | stop
    # the bonus: the inverse CDF at the last uniform (sampling.sample's, with a pre-drawn number)
    bonus = inverse_cdf(bonus_p, u[:, -1])
    n = torch.gather(tree.depth, 1, node[:, None])[:, 0]
    return Acceptance(_path_from_leaf(tree, node, max_depth), n, bonus)
