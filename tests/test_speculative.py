"""Speculative decoding is lossless: greedy output is token-identical to plain greedy decoding,
and sampled output follows the target's distribution.

Tiny random targets keep these fast. An "oracle" EAGLE-2 head makes acceptance non-trivial:
on a 1-layer target whose attention and MLP write nothing, the final state is
norm(embed(token)), so the next token depends on the current one only; a head with
fc = [I | 0] and silent attention/MLP outputs g = embed(token), whose logits through the
shared lm_head have the same argmax (RMSNorm only rescales). It predicts every greedy token.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from scipy.stats import binomtest, chisquare

from eagle_infer.bench import tree_tag
from eagle_infer.errors import UserError
from eagle_infer.generate import generate
from eagle_infer.heads import DraftHead, HeadConfig
from eagle_infer.model import ModelConfig, Transformer
from eagle_infer.sampling import SamplingParams, logits_to_probs, penalize
from eagle_infer.speculative import SpecDecoder, SpecStats, generate_speculative
from eagle_infer.tree import DraftTree, TreeConfig, accept_greedy, ancestor_mask, draft_tree, ngram_lookup

torch.set_num_threads(1)  # tiny models: threads only add latency (and thrash on a busy machine)

TREES = [TreeConfig(), TreeConfig.chain(4), TreeConfig(num_steps=3, eagle_topk=2, num_draft_tokens=6),
         TreeConfig(num_steps=6, eagle_topk=8, num_draft_tokens=32), TreeConfig(2, 4, 6, ngram_branch=4)]


tree_id = tree_tag


def tiny_target(vocab: int = 96, layers: int = 2, seed: int = 0, silent: bool = False) -> Transformer:
    cfg = ModelConfig(model_type="llama", vocab_size=vocab, hidden_size=32, intermediate_size=64,
                      num_layers=layers, num_heads=4, num_kv_heads=2, head_dim=8,
                      max_position_embeddings=512, eos_token_ids=[])
    torch.manual_seed(seed)
    m = Transformer(cfg)
    with torch.no_grad():
        m.embed_tokens.weight.normal_(0, 1.0)
        m.lm_head.weight.normal_(0, 0.6)
        if silent:
            for layer in m.layers:
                layer.self_attn.o_proj.weight.zero_()
                layer.mlp.down_proj.weight.zero_()
    return m.eval().requires_grad_(False)


def random_head(target: Transformer, kind: str, draft_vocab: int | None = None, seed: int = 1) -> DraftHead:
    cfg = HeadConfig.for_target(target.config, kind, draft_vocab_size=draft_vocab,
                                aux_hidden_indices=[0, 1, 2] if kind == "eagle3" else None)
    torch.manual_seed(seed)
    head = DraftHead(cfg, target.embed_tokens, target.lm_head.weight)
    if kind == "eagle3" and draft_vocab:
        ids = torch.randperm(cfg.vocab_size)[:draft_vocab].sort().values
        head.d2t.copy_(ids - torch.arange(draft_vocab))
        head.t2d.zero_()
        head.t2d[ids] = True
    return head.eval().requires_grad_(False)


def oracle_head(target: Transformer, noise: float = 0.0) -> DraftHead:
    head = random_head(target, "eagle2")
    h = target.config.hidden_size
    with torch.no_grad():
        head.fc.weight.zero_()
        head.fc.weight[:, :h] = torch.eye(h) + noise * torch.randn(h, h)
        head.layers[0].self_attn.o_proj.weight.zero_()
        head.layers[0].mlp.down_proj.weight.zero_()
    return head


def prompts_for(vocab: int, lens=(5, 11, 3, 17), seed: int = 3) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in lens]


@pytest.mark.parametrize("tree", TREES, ids=tree_id)
@pytest.mark.parametrize("kind", ["eagle2", "eagle3"])
def test_greedy_identical_random_head(kind, tree):
    target = tiny_target(layers=3)
    head = random_head(target, kind, draft_vocab=40 if kind == "eagle3" else None)
    prompts = prompts_for(target.config.vocab_size)
    plain = generate(target, prompts, 40)
    spec, stats = generate_speculative(target, head, prompts, 40, tree=tree)  # batch 4
    assert spec == plain
    for p, ref in zip(prompts, plain):  # batch 1
        assert generate_speculative(target, head, [p], 40, tree=tree)[0][0] == ref
    assert 1.0 <= stats.acceptance_length() <= tree.max_depth + 1


@pytest.mark.parametrize("arch", ["qwen3", "mistral_window", "phi3", "gemma2", "gemma3"])
def test_greedy_identical_on_checkpoints_of_other_layer_kinds(tiny_model_dir, arch):
    """Checkpoints through the loader, fp32 on their CPU Linears, with an EAGLE-3 head: Qwen3's
    (query/key norms), Mistral-7B-v0.1's kind (every layer sliding), Phi-3's (partial rotary,
    LongRoPE), Gemma 2's (soft-capped scores and logits)
    and Gemma 3's (sliding layers of a window of 8, which these 3-17-token prompts and 24 new tokens
    outgrow; sandwich norms): speculative
    greedy decoding equals plain greedy, eager (batch 4 and 1) and with the compiled steps."""
    from eagle_infer.loader import load_model

    target = load_model(tiny_model_dir(arch), "fp32", "cpu")
    assert target.fused_layers is None
    head = random_head(target, "eagle3", draft_vocab=64)
    prompts = prompts_for(target.config.vocab_size)
    plain = generate(target, prompts, 24)
    for tree in (TreeConfig(), TreeConfig(2, 4, 6, ngram_branch=4), TreeConfig.chain(3)):
        assert generate_speculative(target, head, prompts, 24, tree=tree)[0] == plain, tree
    assert generate_speculative(target, head, prompts[:1], 24)[0] == plain[:1]
    if arch in ("mistral_window", "phi3", "gemma2"):  # Llama's layers, other masks or tables; Gemma 3's
        return
    assert generate(target, prompts, 24, compile=True) == plain
    tree = TreeConfig(3, 4, 4)
    dec = SpecDecoder(target, head, tree, max_batch=4, max_seq_len=128).compile()
    assert generate_speculative(target, head, prompts, 24, tree=tree, decoder=dec)[0] == plain


@pytest.mark.parametrize("tree", TREES, ids=tree_id)
def test_oracle_head_accepts_whole_paths(tree):
    target = tiny_target(layers=1, silent=True)
    head = oracle_head(target)
    prompts = prompts_for(target.config.vocab_size)
    plain = generate(target, prompts, 30)
    spec, stats = generate_speculative(target, head, prompts, 30, tree=tree)
    assert spec == plain
    # Every round but a sequence's last (cut by max tokens) accepts the full depth.
    assert stats.acceptance_length() > 0.8 * (tree.num_steps + 1)
    assert stats.accept_rate_per_position(tree.num_steps)[0] > 0.9


def test_noisy_oracle_partial_acceptance_still_exact():
    target = tiny_target(layers=1, silent=True)
    head = oracle_head(target, noise=0.9)
    prompts = prompts_for(target.config.vocab_size)
    plain = generate(target, prompts, 40)
    spec, stats = generate_speculative(target, head, prompts, 40, tree=TreeConfig(4, 3, 10))
    assert spec == plain
    rates = stats.accept_rate_per_position(4)
    fewest = min(k for k, n in enumerate(stats.accepted_hist) if n)
    assert 0 < fewest < 4 or 0 < rates[0] < 1, "want partial acceptance"


@pytest.mark.parametrize("map_size", [8, 48])
def test_token_map_greedy_identical(map_size):
    target = tiny_target(layers=1, silent=True)
    head = oracle_head(target)
    ids = torch.randperm(target.config.vocab_size, generator=torch.Generator().manual_seed(0))[:map_size]
    head.set_token_map(ids)
    prompts = prompts_for(target.config.vocab_size)
    plain = generate(target, prompts, 30)
    spec, stats = generate_speculative(target, head, prompts, 30, tree=TreeConfig(4, 2, 8))
    assert spec == plain
    # Drafts can only propose mapped tokens.
    assert head.draft_to_target is not None and head.draft_lm_head.shape[0] == map_size


def test_eos_and_max_tokens_stop_each_sequence():
    target = tiny_target(layers=1, silent=True)
    head = oracle_head(target)
    prompts = prompts_for(target.config.vocab_size)
    plain = generate(target, prompts, 25)
    eos = plain[0][6]  # a token the first sequence emits mid-way
    plain_eos = generate(target, prompts, 25, eos_token_ids=[eos])
    spec, _ = generate_speculative(target, head, prompts, 25, tree=TreeConfig(5, 2, 8), eos_token_ids=[eos])
    assert spec == plain_eos
    assert spec[0][-1] == eos and len(spec[0]) <= 7
    assert all(len(s) <= 25 for s in spec)


def staggered_jobs():
    """A 2-layer target, an EAGLE-3 head, four prompts with output lengths that finish apart (a
    batch of 4 running down through 3, 2 and 1), and plain greedy decoding's output of each."""
    target = tiny_target(layers=2)
    head = random_head(target, "eagle3", draft_vocab=50)
    prompts = prompts_for(target.config.vocab_size)
    lengths = [3, 30, 9, 21]
    return target, head, prompts, lengths, [generate(target, [p], n)[0] for p, n in zip(prompts, lengths)]


def test_finished_sequence_leaves_without_disturbing_others():
    target, head, prompts, lengths, plain = staggered_jobs()
    from eagle_infer.speculative import Sequence_

    dec = SpecDecoder(target, head, TreeConfig(3, 2, 6), max_batch=4, max_seq_len=256)
    seqs = [Sequence_(p, SamplingParams(), n, set()) for p, n in zip(prompts, lengths)]
    for s in seqs[:2]:
        dec.add(s)
    dec.step()
    for s in seqs[2:]:  # join between rounds
        dec.add(s)
    while dec.seqs:
        dec.step()
    assert [s.output for s in seqs] == plain
    assert all(s.finish_reason == "length" for s in seqs)


def test_tree_selection_is_a_tree_with_correct_mask():
    target = tiny_target(layers=2)
    head = random_head(target, "eagle2")
    cfg = TreeConfig(num_steps=4, eagle_topk=3, num_draft_tokens=12)
    dec = SpecDecoder(target, head, cfg, max_batch=2, max_seq_len=128)
    from eagle_infer.speculative import Sequence_

    for p in prompts_for(target.config.vocab_size, lens=(6, 9)):
        dec.add(Sequence_(p, SamplingParams(), 50, set()))
    tree = draft_tree(cfg, dec.draft_fn, dec.root[:2], dec.root_logp[:2], dec.root_g[:2], dec.L[:2], 64,
                      None)
    assert tree.tokens.shape == (2, 12)
    for b in range(2):
        par, dep = tree.parent[b].tolist(), tree.depth[b].tolist()
        for i in range(1, 12):
            assert par[i] < i and dep[i] == dep[par[i]] + 1  # parents first, depth consistent
            kids = [j for j in range(1, 12) if par[j] == par[i]]
            assert len({int(tree.tokens[b, j]) for j in kids}) == len(kids)  # distinct siblings
        expect = torch.zeros(12, 12, dtype=torch.bool)
        for i in range(12):
            j = i
            while True:
                expect[i, j] = True
                if j == 0:
                    break
                j = par[j]
        assert torch.equal(tree.mask[b], expect)


def test_accept_greedy_walks_the_matching_branch():
    # root(0) -> 1(a) -> 3(c); root -> 2(b) -> 4(d); target wants b then d then e.
    parent = torch.tensor([[0, 0, 0, 1, 2]])
    depth = torch.tensor([[0, 1, 1, 2, 2]])
    tokens = torch.tensor([[9, 5, 6, 7, 8]])
    tree = DraftTree(tokens, parent, depth, ancestor_mask(parent, 2))
    V = 12
    logits = torch.zeros(1, 5, V)
    logits[0, 0, 6] = 5  # after root: b
    logits[0, 2, 8] = 5  # after b: d
    logits[0, 4, 11] = 5  # after d: e (bonus)
    logits[0, 1, 3] = 5
    logits[0, 3, 3] = 5
    acc = accept_greedy(tree, logits, max_depth=2)
    assert acc.n_accepted.tolist() == [2]
    assert acc.path.tolist() == [[0, 2, 4]]
    assert acc.bonus.tolist() == [11]


def test_ngram_lookup_proposes_what_followed_the_latest_match():
    junk = [99] * 4  # past each row's end: never read
    history = torch.tensor([[5, 6, 7, 8, 5, 6, 7, 99] + junk,  # "5 6 7" seen 4 back: 8 5 6 7 8
                            [1, 2, 9, 1, 2, 8, 1, 2] + junk,  # "1 2" latest 3 back: 8 1 2 8 1
                            [1, 2, 3, 4, 0, 0, 0, 0] + junk])  # the root 4 seen nowhere before
    chain, n = ngram_lookup(history, torch.tensor([6, 7, 3]), 5)
    assert n.tolist() == [3, 2, 0]
    assert chain.tolist() == [[8, 5, 6, 7, 8], [8, 1, 2, 8, 1], [4, 4, 4, 4, 4]]


def draft_with_loop(root_logp: torch.Tensor, cfg: TreeConfig) -> DraftTree:
    """draft_tree over the history 3 4 5 6 3 4 5 6 3 4 5 (a loop: the lookup's chain 6 3 4 5 from
    a match of 4) with the root's log-probs given and a draft step that knows nothing."""
    V, h = root_logp.shape[-1], 8

    def step(tokens, feat, pos, mask, slots):
        return torch.zeros(*tokens.shape, V), torch.zeros(*tokens.shape, h)
    history = torch.tensor([[3, 4, 5, 6] * 2 + [3, 4, 5] + [0] * 8])
    return draft_tree(cfg, step, torch.tensor([5]), root_logp, torch.zeros(1, h), torch.tensor([10]), 32,
                      None, history)


def tree_paths(tree: DraftTree) -> set[tuple[int, ...]]:
    """Each node's tokens from the root's child down to it."""
    par, tok = tree.parent[0].tolist(), tree.tokens[0].tolist()
    paths = set()
    for i in range(1, len(par)):
        path, j = [], i
        while j:
            path.append(tok[j])
            j = par[j]
        paths.add(tuple(reversed(path)))
    return paths


def test_ngram_branch_competes_for_places_and_merges_with_the_draft():
    """A loop's chain (0.87-0.9 a token) outscores a weak draft's nodes (log-prob -2) and takes
    four of the five places as a path from the root; where the draft's depth-1 nodes hold its
    first token, the chain continues under that node (no second child of the same token)."""
    cfg = TreeConfig(2, 4, 6, ngram_branch=4)
    weak = torch.full((1, 20), -10.0)
    weak[0, 10:14] = -2.0  # the draft's four: tokens 10-13
    tree = draft_with_loop(weak, cfg)
    assert tree.tokens.shape == (1, 6)
    assert {(6, 3, 4, 5)} <= tree_paths(tree) and len(tree_paths(tree)) == 5
    assert sorted(tree.depth[0].tolist()) == [0, 1, 1, 2, 3, 4]
    assert torch.equal(tree.mask, ancestor_mask(tree.parent, cfg.max_depth))
    likes_6 = weak.clone()
    likes_6[0, 6] = -0.5  # the draft's best depth-1 node is the chain's first token
    tree = draft_with_loop(likes_6, cfg)
    paths = tree_paths(tree)
    assert (6, 3, 4, 5) in paths
    assert sum(1 for p in paths if p == (6,)) == 1  # one node of 6 at depth 1, the chain under it
    assert sum(1 for p in paths if len(p) == 1) == 2  # and one draft node: 10, 11 or 12
    untouched = draft_with_loop(weak, TreeConfig(2, 4, 6))
    assert not any(6 in p for p in tree_paths(untouched))


def test_ngram_branch_is_lossless_and_accepts_loops():
    """A target whose next token depends on the current one only falls into loops; a head that
    knows nothing accepts ~nothing, the lookup's chain whole loops: the same tokens either way."""
    target = tiny_target(layers=1, silent=True)
    head = random_head(target, "eagle2")
    prompts = prompts_for(target.config.vocab_size)
    plain = generate(target, prompts, 60)
    base, base_stats = generate_speculative(target, head, prompts, 60, tree=TreeConfig(2, 4, 6))
    out, stats = generate_speculative(target, head, prompts, 60, tree=TreeConfig(2, 4, 6, ngram_branch=4))
    assert base == out == plain
    assert stats.acceptance_length() > base_stats.acceptance_length() + 1.0, (stats, base_stats)
    assert stats.accepted_hist[4] > 0  # whole chains, deeper than the draft's two steps


def test_penalized_tree_nodes_see_their_paths_as_emitted():
    """sampling.penalize over a verify's tree: each node's logits are penalized as one plain
    step's would be after the row's output and the drafted tokens on that node's path (a token
    the path repeats counts twice; a sibling's token does not count)."""
    from eagle_infer.sampling import penalize

    V = 30
    parent = torch.tensor([[0, 0, 0, 1, 1, 3, 5], [0, 0, 1, 2, 3, 0, 5]])
    tokens = torch.tensor([[7, 3, 4, 3, 9, 3, 4], [2, 2, 2, 5, 2, 8, 7]])
    mask = ancestor_mask(parent, 6)
    logits = torch.randn(2, 7, V, generator=torch.Generator().manual_seed(0))
    # bad words: 4 after 3, and 3 after 7 3 (the output's last token, then node 1's)
    params = [SamplingParams(frequency_penalty=0.7, presence_penalty=0.3, repetition_penalty=1.4,
                             min_tokens=4, bad_words=[[3, 4], [7, 3, 3], [11]]),
              SamplingParams(frequency_penalty=-0.5, logit_bias={2: 1.5}, allowed_token_ids=[2, 5, 8, 20])]
    prompts, outputs = [[1, 2, 3], [4]], [[5, 7], [2]]  # each output ends with its tree's root
    stops = [{0, 9}, {0}]  # row 0's stop tokens barred at depths 0 and 1 (2 + depth < 4 tokens)
    out = penalize(logits, params, prompts, outputs, stops, tokens, mask)
    assert out[0, :, 9].isneginf().tolist() == [True, True, True, False, False, False, False]
    assert out[0, :, 4].isneginf().tolist() == [False, True, False, True, False, True, False]
    assert out[0, :, 3].isneginf().tolist() == [False, True, False, False, False, False, False]
    assert out[0, :, 11].isneginf().all() and out[1].isfinite().sum(-1).tolist() == [4] * 7
    for b in range(2):
        for j in range(7):
            path, k = [], j
            while k:
                path.insert(0, int(tokens[b, k]))
                k = int(parent[b, k])
            one = penalize(logits[b:b + 1, j:j + 1], params[b:b + 1], prompts[b:b + 1], [outputs[b] + path],
                           stops[b:b + 1])
            torch.testing.assert_close(out[b, j], one[0, 0], msg=f"row {b} node {j} path {path}")


PENALTIES = [SamplingParams(frequency_penalty=1.2, presence_penalty=0.4),
             SamplingParams(repetition_penalty=1.6), SamplingParams(logit_bias={5: 2.0, 53: -100.0}),
             SamplingParams(frequency_penalty=-0.8, repetition_penalty=0.7)]


@pytest.mark.parametrize("tree", [TreeConfig(4, 3, 10, ngram_branch=3), TreeConfig.chain(4)], ids=tree_id)
def test_penalized_greedy_is_plain_penalized_greedy(tree):
    """Penalties and logit_bias are lossless under speculation: greedy speculative decoding with
    them equals plain greedy decoding with them, token for token, each row with its own settings
    (one without), where rounds accept several tokens (a noisy oracle head), so a node's penalties
    count the drafted tokens before it; the server's plain decoder and rounds without drafts
    agree too. The settings change the output (else the test would prove nothing)."""
    from eagle_infer.engine import PlainDecoder
    from eagle_infer.speculative import Sequence_

    target = tiny_target(layers=1, silent=True)
    head = oracle_head(target, noise=0.3)
    prompts = prompts_for(target.config.vocab_size)
    unpenalized = generate(target, prompts, 40)
    params = PENALTIES[:3] + [SamplingParams()]
    # vLLM's allowed_token_ids and bad_words on the third row too: a token its output uses left
    # out, then a bigram of the new output barred (each changes the output)
    before = generate(target, prompts[2:3], 40, params[2])[0]
    vocab = range(target.config.vocab_size)
    params[2] = replace(params[2], allowed_token_ids=[t for t in vocab if t != before[2]])
    allowed = generate(target, prompts[2:3], 40, params[2])[0]
    params[2] = replace(params[2], bad_words=[allowed[10:12]])
    plain = generate(target, prompts, 40, params)
    assert all(a != b for a, b in zip(plain[:3], unpenalized[:3])) and plain[3] == unpenalized[3]
    assert before[2] not in allowed and plain[2] != allowed and plain[2].count(allowed[10]) >= 3
    assert not any(plain[2][i:i + 2] == allowed[10:12] for i in range(39))
    spec, stats = generate_speculative(target, head, prompts, 40, params, tree=tree)
    assert spec == plain and sum(stats.accepted_hist[2:]) > 0  # rounds that accepted 2+ drafts
    for p, ref in zip(prompts, generate(target, prompts, 40, PENALTIES[3])):  # batch 1
        assert generate_speculative(target, head, [p], 40, PENALTIES[3], tree=tree)[0][0] == ref
    for dec in (PlainDecoder(target, max_batch=4, max_seq_len=128),
                SpecDecoder(target, head, tree, max_batch=4, max_seq_len=128, disable_by_batch_size=0)):
        seqs = [Sequence_(p, s, 40, set()) for p, s in zip(prompts, params)]
        dec.add_many(seqs)
        while dec.seqs:
            dec.step()
        assert [s.output for s in seqs] == plain, type(dec).__name__


def test_min_tokens_bar_the_stop_tokens_until_then_under_speculation_too():
    """min_tokens: a stop token cannot end a row before it has that many tokens, in plain and
    speculative decoding alike (greedy, the same tokens), though the rounds accept several
    tokens at once (a node's depth counts)."""
    target = tiny_target(layers=1, silent=True)
    head = oracle_head(target, noise=0.3)
    prompts = prompts_for(target.config.vocab_size)
    stop = [53]  # in the loop the target falls into (test_penalized_greedy_is_plain_penalized_greedy)
    free = generate(target, prompts, 40, eos_token_ids=stop)
    assert all(out[-1] == 53 and len(out) < 20 for out in free), free
    params = SamplingParams(min_tokens=20)
    plain = generate(target, prompts, 40, params, eos_token_ids=stop)
    assert all(len(out) >= 20 and 53 not in out[:19] for out in plain), plain
    tree = TreeConfig(4, 3, 10, ngram_branch=3)
    spec, stats = generate_speculative(target, head, prompts, 40, params, tree=tree, eos_token_ids=stop)
    assert spec == plain and sum(stats.accepted_hist[2:]) > 0


def pair_grammar(vocab: int, stop: int, regex: str = "([0-4][5-9])+"):
    """A grammar over a vocabulary whose tokens 0-9 are the digits (the rest other text): pairs of
    a digit 0-4 then 5-9, at least one, then the stop token. What may follow a token depends on
    the token before it, so a tree node's mask depends on its drafted path."""
    import xgrammar as xgr

    from eagle_infer.grammar import Grammars

    text = [str(i) for i in range(10)] + [f"<{i}>" for i in range(10, vocab)]
    return Grammars(xgr.TokenizerInfo(text, vocab_size=vocab, stop_token_ids=[stop])).compile("regex", regex)


def test_grammar_masks_each_tree_node_after_its_path(capfd):
    """penalize with a grammar: each node's allowed tokens are the grammar's after the output and
    the node's drafted path (a node under a forbidden token is unreachable: all allowed), and the
    matcher keeps the output's state; a node under a drafted stop token is not fed to the ended
    matcher (xgrammar warned on stderr at each such node)."""
    from eagle_infer.grammar import new_matcher

    V, stop = 12, 11
    grammar = pair_grammar(V, stop)
    matcher = new_matcher(grammar)
    assert matcher.accept_token(2)  # the output so far: "2"
    parent = torch.tensor([[0, 0, 0, 1, 1, 3]])
    tokens = torch.tensor([[2, 7, 3, 1, 8, 6]])  # node 2 (3 after 2) and 4 (8 after 7) are forbidden
    logits = torch.zeros(1, 6, V)
    params = [SamplingParams(grammar=grammar)]
    out = penalize(logits, params, [[0]], [[2]], [{stop}], tokens, ancestor_mask(parent, 5), [matcher])
    low, high, everything = set(range(5)) | {stop}, set(range(5, 10)), set(range(V))
    assert [set(out[0, j].isfinite().nonzero().flatten().tolist()) for j in range(6)] == [
        high, low, everything, high, everything, low]
    again = penalize(logits[:, :1], params, [[0]], [[2]], [{stop}], matchers=[matcher])
    assert set(again[0, 0].isfinite().nonzero().flatten().tolist()) == high
    # a drafted stop token the grammar accepts ends it: the node after it is unreachable (the
    # answer ends there), all allowed, and the matcher is not asked for a mask past its end
    ended = penalize(logits[:, :4], params, [[0]], [[2]], [{stop}], torch.tensor([[2, 7, stop, 3]]),
                     ancestor_mask(torch.tensor([[0, 0, 1, 2]]), 5), [matcher])
    allowed = [set(ended[0, j].isfinite().nonzero().flatten().tolist()) for j in range(4)]
    assert allowed == [high, low, everything, everything]
    assert not matcher.is_terminated()
    assert "matcher has terminated" not in capfd.readouterr().err


def test_grammar_greedy_is_plain_grammar_greedy():
    """Structured outputs are lossless under speculation: greedy speculative decoding with a
    grammar writes plain decoding's tokens with it (the server's plain decoder), rows with and
    without a grammar in one batch, where rounds accept several drafts (a node's mask follows its
    path), and generate()'s; the output keeps the grammar, ending with its stop token, and differs
    from the free output."""
    import re

    from eagle_infer.engine import PlainDecoder
    from eagle_infer.speculative import Sequence_

    target = tiny_target(layers=1, silent=True)
    # The digits' next token, by the last alone: the pairs 0 5 1 6 2 7 ..., but 7 after 7 (the
    # grammar's 3 second): drafts (the oracle's raw argmax) chain through the pairs and break at 7
    with torch.no_grad():
        q = torch.linalg.qr(torch.randn(32, 32, generator=torch.Generator().manual_seed(0)))[0]
        digit = target.embed_tokens.weight[:10] = q[:10] * 32 ** 0.5  # orthogonal, RMS 1
        lm_head = target.lm_head.weight
        lm_head[:10] = 0
        for d in range(10):
            lm_head[7 if d == 7 else d + 5 if d < 5 else d - 5 + 1 if d < 9 else 0] += digit[d]
        lm_head[3] += 0.5 * digit[7]
    V, stop = target.config.vocab_size, 95
    head = oracle_head(target, noise=0.3)
    params = [SamplingParams(grammar=pair_grammar(V, stop))] * 3 + [SamplingParams()]
    prompts = prompts_for(V)
    outs = []
    tree = TreeConfig(4, 3, 10, ngram_branch=3)
    # rounds with drafts, then rounds without (above 0 sequences: all of them)
    decoders = [PlainDecoder(target, max_batch=4, max_seq_len=128),
                *[SpecDecoder(target, head, tree, max_batch=4, max_seq_len=128, disable_by_batch_size=d)
                  for d in (8, 0)]]
    for dec in decoders:
        seqs = [Sequence_(p, s, 30, {stop}) for p, s in zip(prompts, params)]
        dec.add_many(seqs)
        if isinstance(dec, SpecDecoder):  # greedy under a grammar: the greedy rounds' graphs
            dec.verify_fn = dec.sampled_tail_fn = None
        while dec.seqs:
            dec.step()
        outs.append([s.output for s in seqs])
    plain, spec, without_drafts = outs
    assert spec == plain and sum(decoders[1].stats.accepted_hist[2:]) > 0  # rounds that accepted 2+ drafts
    assert without_drafts == plain and decoders[2].stats.plain_rounds > 0
    assert all((d.all_allowed == -1).all() for d in decoders[1:])  # the rows without a grammar's mask
    for out in plain[:3]:
        body = out[:-1] if out[-1] == stop else out
        assert re.fullmatch("([0-4][5-9])*[0-4]?", "".join(map(str, body))), out
        assert len(out) == 30 or out[-1] == stop and len(body) % 2 == 0
    assert plain == generate(target, prompts, 30, params, eos_token_ids=[stop])  # generate() too
    # a grammar that ends (one pair, then its stop token) while the batch goes on
    one_pair = [SamplingParams(grammar=pair_grammar(V, stop, "[0-4][5-9]")), SamplingParams()]
    ends = generate(target, prompts[:2], 30, one_pair, eos_token_ids=[])
    assert [len(o) for o in ends] == [3, 30] and ends[0][-1] == stop
    assert generate_speculative(target, head, prompts[:2], 30, one_pair, eos_token_ids=[])[0] == ends
    assert plain[:3] != generate(target, prompts[:3], 30) and plain[3] == generate(target, prompts[3:], 30)[0]


def test_a_gated_grammar_starts_after_its_gate_under_speculation_too():
    """Grammar.gate (a thinking model's end of reasoning, --reasoning-parser): the output is free
    until it ends with the gate's tokens, then follows the grammar; greedy speculative decoding
    writes plain decoding's tokens (tree nodes whose drafted path crosses the gate are masked by
    the grammar after it), sampled rows keep it too, and a path rolled back across the gate
    closes it again."""
    import re
    from dataclasses import replace

    from eagle_infer.grammar import new_matcher

    target = tiny_target(layers=1, silent=True)
    V, stop = target.config.vocab_size, 95
    head = oracle_head(target, noise=0.3)
    prompts = prompts_for(V)[:2]
    free = generate(target, prompts, 30, eos_token_ids=[])
    gate = tuple(free[0][3:5])  # the first prompt's free answer holds it: the grammar starts there
    start = next(i for i in range(2, 30) if tuple(free[0][i - 1:i + 1]) == gate) + 1
    gated = replace(pair_grammar(V, stop), gate=gate)
    params = [SamplingParams(grammar=gated)] * 2
    plain = generate(target, prompts, 30, params, eos_token_ids=[stop])
    assert plain[0][:start] == free[0][:start] and plain[0] != free[0]  # free until the gate
    body = plain[0][start:-1] if plain[0][-1] == stop else plain[0][start:]
    assert re.fullmatch("([0-4][5-9])*[0-4]?", "".join(map(str, body))), plain[0]
    spec, stats = generate_speculative(target, head, prompts, 30, params, tree=TreeConfig(3, 3, 8),
                                       eos_token_ids=[stop])
    assert spec == plain and sum(stats.accepted_hist[1:]) > 0
    sampled = [SamplingParams(temperature=1.0, seed=s, grammar=gated) for s in (1, 2)]
    for out in generate_speculative(target, head, prompts, 30, sampled, tree=TreeConfig(3, 3, 8),
                                    eos_token_ids=[stop])[0]:
        at = next((i + 1 for i in range(1, len(out)) if tuple(out[i - 1:i + 1]) == gate), len(out))
        body = out[at:-1] if out[-1] == stop else out[at:]
        assert re.fullmatch("([0-4][5-9])*[0-4]?", "".join(map(str, body))), out
    matcher = new_matcher(gated)
    assert all(matcher.accept_token(t) for t in (*gate, 2)) and not matcher.accept_token(3)
    matcher.rollback(2)  # the 2, then the gate's last token: closed again, 3 allowed
    assert not matcher.started and matcher.accept_token(3) and matcher.free == [gate[0], 3]


def test_a_thinking_budget_forces_the_gate_under_speculation_too():
    """Grammar.budget (thinking_token_budget): at most `budget` tokens before the gate, then the
    gate's tokens are forced, then the output is free again (no grammar after it). Greedy
    speculative decoding writes plain decoding's tokens (the forced gate drafted ahead), sampled
    rows keep the budget too, and an output that writes the gate itself within the budget is left
    as it is."""
    from eagle_infer.grammar import Grammar

    target = tiny_target(layers=1, silent=True)
    V = target.config.vocab_size
    head = oracle_head(target, noise=0.3)
    prompts = prompts_for(V)[:2]
    free = generate(target, prompts, 30, eos_token_ids=[])
    pairs = {tuple(out[i:i + 2]) for out in free for i in range(len(out) - 1)}
    gate = next((a, b) for a in range(V) for b in range(V) if (a, b) not in pairs and a != free[0][6])
    params = [SamplingParams(grammar=Grammar(None, None, gate, budget=6))] * 2
    plain = generate(target, prompts, 30, params, eos_token_ids=[])
    for out, was in zip(plain, free):
        assert out[:6] == was[:6] and tuple(out[6:8]) == gate and out != was
    spec, stats = generate_speculative(target, head, prompts, 30, params, tree=TreeConfig(3, 3, 8),
                                       eos_token_ids=[])
    assert spec == plain and sum(stats.accepted_hist[1:]) > 0
    sampled = [SamplingParams(temperature=1.0, seed=s, grammar=params[0].grammar) for s in (1, 2)]
    for out in generate_speculative(target, head, prompts, 30, sampled, tree=TreeConfig(3, 3, 8),
                                    eos_token_ids=[])[0]:
        assert any(tuple(out[i:i + 2]) == gate for i in range(7)), out  # the gate begun by position 6
    own = [SamplingParams(grammar=Grammar(None, None, tuple(free[0][3:5]), budget=20))]
    assert generate(target, prompts[:1], 30, own, eos_token_ids=[]) == free[:1]


def test_a_spent_budget_allows_only_the_gates_next_token():
    """GatedMatcher with a budget: free tokens up to it, then only the gate's next token is allowed
    (the bitmask, accept_token), after the longest tail that begins the gate; rolled back, the
    budget is open again; after the gate, every token."""
    import xgrammar as xgr

    from eagle_infer.grammar import Grammar, forced_tokens, new_matcher

    def allowed(matcher) -> list[int]:
        bitmask = xgr.allocate_token_bitmask(1, 96)
        matcher.fill_next_token_bitmask(bitmask, 0)
        return [t for t in range(96) if (int(bitmask[0, t // 32]) >> (t % 32)) & 1]

    matcher = new_matcher(Grammar(None, None, (31, 9), budget=2))
    assert all(matcher.accept_token(t) for t in (1, 2)) and matcher.forced() == (31, 9)
    assert allowed(matcher) == [31] and not matcher.accept_token(3)  # bit 31 of a word: its sign bit
    assert forced_tokens(matcher, None, 8) == [31, 9] and matcher.forced() == (31, 9)
    assert matcher.accept_token(31) and allowed(matcher) == [9]
    matcher.rollback(2)
    assert matcher.forced() == () and len(allowed(matcher)) == 96
    assert all(matcher.accept_token(t) for t in (31, 9, 4)) and matcher.started
    assert len(allowed(matcher)) == 96 and not matcher.is_terminated()
    begun = new_matcher(Grammar(None, None, (5, 9), budget=2))
    assert begun.accept_token(1) and begun.accept_token(5) and begun.forced() == (9,)


def test_masked_greedy_tokens_is_the_argmax_the_bitmask_allows():
    """masked_greedy_tokens reads xgrammar's bitmask as xgrammar applies it (bit 31 of a word
    included, a vocabulary not a multiple of 32): the argmax of what is left, the raw argmax
    under an all-allowed mask."""
    import xgrammar as xgr

    from eagle_infer.sampling import masked_greedy_tokens

    gen = torch.Generator().manual_seed(0)
    V = 100
    logits = torch.randn(3, 5, V, generator=gen)
    bitmask = torch.randint(-2**31, 2**31 - 1, (3, 5, (V + 31) // 32), generator=gen, dtype=torch.int32)
    bitmask[0, 0] = 0
    bitmask[0, 0, 0] = 1 << 3  # one token allowed
    bitmask[0, 1] = 0
    bitmask[0, 1, 1] = -2**31  # token 63 alone (bit 31)
    expected = logits.clone().view(-1, V)
    xgr.apply_token_bitmask_inplace(expected, bitmask.view(-1, bitmask.shape[-1]))
    got = masked_greedy_tokens(logits, bitmask)
    assert torch.equal(got, expected.view(3, 5, V).argmax(-1))
    assert got[0, 0] == 3 and got[0, 1] == 63 and not torch.equal(got, logits.argmax(-1))
    assert torch.equal(masked_greedy_tokens(logits, torch.full_like(bitmask, -1)), logits.argmax(-1))


def test_compiled_plain_decoding_takes_the_grammar_in_its_graph(monkeypatch):
    """Plain decoding's compiled step takes each row's grammar bitmask (grammar_bitmask) and
    returns the argmax among the allowed tokens, so greedy rows under a grammar alone skip the
    eager penalize after the first token (generate(), PlainDecoder): the same tokens as eager
    decoding, rows with and without a grammar in one batch, a grammar ending mid-batch."""
    import re

    import eagle_infer.engine as engine_mod
    import eagle_infer.generate as generate_mod
    from eagle_infer.engine import PlainDecoder
    from eagle_infer.speculative import Sequence_

    target = tiny_target(layers=1, silent=True)
    V, stop = target.config.vocab_size, 95
    params = [SamplingParams(grammar=pair_grammar(V, stop)), SamplingParams(),
              SamplingParams(grammar=pair_grammar(V, stop, "[0-4][5-9]"))]
    prompts = prompts_for(V)[:3]
    eager = generate(target, prompts, 16, params, eos_token_ids=[stop])
    body = eager[0][:-1] if eager[0][-1] == stop else eager[0]
    assert re.fullmatch("([0-4][5-9])*[0-4]?", "".join(map(str, body)))
    assert len(eager[2]) == 3 and eager[2][-1] == stop and len(eager[1]) == 16
    counted = []
    for mod in (generate_mod, engine_mod):
        real = mod.penalize if mod is generate_mod else mod.penalize_seqs
        name = "penalize" if mod is generate_mod else "penalize_seqs"
        monkeypatch.setattr(mod, name, lambda *a, real=real, **k: counted.append(1) or real(*a, **k))
    assert generate(target, prompts, 16, params, eos_token_ids=[stop], compile=True) == eager
    assert len(counted) == 1  # the first token's, from the prefill's logits
    dec = PlainDecoder(target, max_batch=4, max_seq_len=128).compile()
    seqs = [Sequence_(p, s, 16, {stop}) for p, s in zip(prompts, params)]
    dec.add_many(seqs)
    while dec.seqs:
        dec.step()
    assert [s.output for s in seqs] == eager and len(counted) == 1


def digits(text: str) -> list[int]:
    """pair_grammar's vocabulary's encode: a digit is its own token."""
    return [int(c) for c in text]


def test_forced_tokens_are_what_the_grammar_forces_next():
    """grammar.forced_tokens: the jump-forward string from the matcher's state, encoded, cut at
    the limit and at the first token the grammar refuses; the matcher keeps its state."""
    from eagle_infer.grammar import forced_tokens, new_matcher

    matcher = new_matcher(pair_grammar(12, 11, "(0123456789[0-4])+"))
    assert matcher.accept_token(0) and matcher.accept_token(1)
    assert forced_tokens(matcher, digits, 4) == [2, 3, 4, 5]
    assert forced_tokens(matcher, digits, 20) == list(range(2, 10))
    assert forced_tokens(matcher, lambda text: [2, 3, 7, 5], 4) == [2, 3]  # 7 is not what follows 3
    assert forced_tokens(matcher, digits, 0) == []
    assert not matcher.accept_token(3) and matcher.accept_token(2)  # its state: after "01"
    for t in range(3, 10):
        assert matcher.accept_token(t)
    assert forced_tokens(matcher, digits, 4) == []  # a free digit 0-4 next


def test_graft_chains_puts_the_forced_tokens_first():
    """graft_chains: a row's chain takes nodes 1..k; a drafted node of the chain's tokens becomes
    its node, drafted nodes below the chain's end come next, then the others, parents before
    children, until the row is full; a chain longer than max_depth is cut; other rows kept."""
    from eagle_infer.tree import graft_chains

    # drafted: root 50 -> 1 (-> 2 -> 3 -> 4), 9 (-> 8), 7
    tokens = torch.tensor([[50, 1, 9, 2, 8, 7, 3, 4]] * 2)
    parent = torch.tensor([[0, 0, 0, 1, 2, 0, 3, 6]] * 2)
    depth = torch.tensor([[0, 1, 1, 2, 2, 1, 3, 4]] * 2)
    tree = DraftTree(tokens, parent, depth, ancestor_mask(parent, 4))
    out = graft_chains(tree, {0: [1, 2, 5, 6, 0]}, max_depth=4)
    # chain 1 2 5 6 (cut at depth 4); drafted 1 and 2 merge into it; then, none lying below 6,
    # the others in order: 9, 8 (under 9), 7, 3 (under 2)
    assert out.tokens[0].tolist() == [50, 1, 2, 5, 6, 9, 8, 7]
    assert out.parent[0].tolist() == [0, 0, 1, 2, 3, 0, 5, 0]
    assert out.depth[0].tolist() == [0, 1, 2, 3, 4, 1, 2, 1]
    assert torch.equal(out.mask, ancestor_mask(out.parent, 4))
    assert all(torch.equal(a[1], b[1]) for a, b in zip(vars(out).values(), vars(tree).values()))
    below = graft_chains(tree, {0: [1, 2]}, max_depth=4).tokens[0].tolist()
    assert below == [50, 1, 2, 3, 4, 9, 8, 7]  # 3 and 4 drafted below the chain's end come first


def test_grammar_drafts_what_it_forces_losslessly():
    """Speculative rounds under a grammar draft what it forces (Grammar.encode given): greedy
    output unchanged (plain decoding's with the grammar) and far more accepted per round than
    the head's drafts alone, which cannot know the forced text."""
    target = tiny_target(layers=1, silent=True)
    V, stop = target.config.vocab_size, 95
    head = oracle_head(target, noise=3.0)  # a poor head
    grammar = pair_grammar(V, stop, "(0123456789[0-4])+")
    assert grammar.encode is None
    prompts = prompts_for(V)[:2]
    tree = TreeConfig(2, 3, 6, ngram_branch=3)
    plain = generate(target, prompts, 40, SamplingParams(grammar=grammar), eos_token_ids=[stop])
    taus = []
    for g in (grammar, replace(grammar, encode=digits)):
        out, stats = generate_speculative(target, head, prompts, 40, SamplingParams(grammar=g), tree=tree,
                                          eos_token_ids=[stop])
        assert out == plain
        taus.append(stats.acceptance_length())
    # up to 3 forced digits (the tree's depth) and the bonus a round, 1 where a free digit is next
    assert taus[1] > 2.5 and taus[0] < 1.5, taus


def test_tree_config_refuses_impossible_sizes():
    with pytest.raises(UserError, match="num_draft_tokens"):
        TreeConfig(num_steps=2, eagle_topk=1, num_draft_tokens=8)
    with pytest.raises(UserError):
        TreeConfig(num_steps=0)
    with pytest.raises(UserError, match="ngram_branch >= 0"):
        TreeConfig(2, 4, 6, ngram_branch=-1)
    assert TreeConfig(2, 4, 6, ngram_branch=8).max_depth == 5  # at most num_draft_tokens - 1


@pytest.mark.parametrize("tree", [TreeConfig(3, 2, 6), TreeConfig(1, 4, 3), TreeConfig(2, 3, 6, 4)],
                         ids=tree_id)
def test_draft_ahead_equals_drafting_at_each_rounds_start(tree):
    """A round drafts the next round's tree at its end (draft ahead): the same trees as a draft
    phase at each round's start, so the same tokens and acceptance, with sequences joining
    between rounds, finishing (their rows move), greedy and sampled rows together (a sampled
    round's graph drafts the next tree too). Only rounds after a join draft at their start.
    With an n-gram branch the lookup reads the history the round before wrote in its graph
    (ahead) or the decoder's own copy (at the start)."""
    target = tiny_target(layers=1, silent=True)
    head = oracle_head(target, noise=0.5)  # accepts some drafts: a stale or misplaced tree would show
    prompts = prompts_for(target.config.vocab_size)
    lengths = [3, 30, 9, 21]
    from eagle_infer.speculative import Sequence_

    runs = {}
    for ahead in (True, False):
        dec = SpecDecoder(target, head, tree, max_batch=4, max_seq_len=256, draft_ahead=ahead)
        phases = []

        def counted(*a, dec=dec, phases=phases, draft_phase=dec.draft_tree_fn):
            phases.append(len(dec.seqs))
            return draft_phase(*a)
        dec.draft_tree_fn = counted
        sampled = SamplingParams(temperature=1.0, seed=7)
        seqs = [Sequence_(p, SamplingParams(), n, set()) for p, n in zip(prompts, lengths)]
        seqs.append(Sequence_(prompts[0], sampled, 4, set()))
        dec.add_many(seqs[:2])
        rounds = 0
        while dec.seqs:
            if rounds == 2:
                dec.add_many(seqs[2:4])  # join between rounds
            if rounds == 12:
                dec.add(seqs[4])  # a sampled sequence: its rounds take the sampled path
            dec.step()
            rounds += 1
        runs[ahead] = [s.output for s in seqs], dec.stats.accepted_hist, rounds, phases
    (out, hist, rounds, phases), (out_sep, hist_sep, rounds_sep, phases_sep) = runs[True], runs[False]
    plain = [generate(target, [p], n)[0] for p, n in zip(prompts, lengths)]
    assert out[:4] == out_sep[:4] == plain
    assert out[4] == out_sep[4] and len(out[4]) == 4  # the sampled sequence draws the same (seeded)
    assert hist == hist_sep and rounds == rounds_sep
    assert len(phases_sep) == rounds
    assert len(phases) == 3  # the first round, and the rounds after each join


@pytest.mark.parametrize("ahead", [True, False], ids=["ahead", "at-start"])
def test_sampled_round_in_one_call_draws_what_the_two_call_round_draws(ahead, monkeypatch):
    """Rows sampled at a temperature (and min-p; greedy rows beside them) run verify, the
    distributions (graph_probs, per-row settings as tensors), the walk, commit and catch-up as
    one call, the uniforms drawn before the verify: seeded, the same tokens and acceptance as
    the round of two calls with the distributions made eagerly between (logits_to_probs),
    which top-p, top-k and penalties still take."""
    target = tiny_target(layers=1, silent=True)
    head = oracle_head(target, noise=0.5)
    prompts = prompts_for(target.config.vocab_size)
    params = [SamplingParams(temperature=0.8, seed=1), SamplingParams(temperature=1.3, min_p=0.05, seed=2),
              SamplingParams(), SamplingParams(temperature=1.0, min_p=0.3, seed=3)]
    runs = []
    for one_call in (True, False):
        if not one_call:
            monkeypatch.setattr(SamplingParams, "graph_distribution", property(lambda self: False))
        dec = SpecDecoder(target, head, TreeConfig(3, 2, 6), max_batch=4, max_seq_len=256, draft_ahead=ahead)
        if one_call:
            dec.verify_fn = dec.sampled_tail_fn = None  # the two-call round's steps: unused
        else:
            dec.sampled_round_fn = None
        runs.append(generate_speculative(target, head, prompts, 30, params, tree=dec.tree, decoder=dec))
    (out, stats), (out_two, stats_two) = runs
    assert out == out_two and stats.accepted_hist == stats_two.accepted_hist
    assert sum(stats.accepted_hist[1:]) >= 5  # rounds accepted drafts
    assert out[2] == generate(target, prompts[2:3], 30)[0]  # the greedy row: plain greedy's tokens
    monkeypatch.undo()
    assert SamplingParams(temperature=0.5, min_p=0.2).graph_distribution
    assert SamplingParams().graph_distribution
    assert not any(SamplingParams(temperature=0.8, **other).graph_distribution
                   for other in (dict(top_p=0.9), dict(top_k=5), dict(presence_penalty=0.1)))


def test_large_batches_run_plain_rounds_and_stay_identical():
    """Over disable_by_batch_size running sequences a round verifies only each root (no drafts):
    the output is still plain decoding's, the head's cache keeps up (speculation resumes as the
    batch shrinks), and plain rounds stay out of the acceptance statistics."""
    target, head, prompts, lengths, plain = staggered_jobs()
    from eagle_infer.speculative import Sequence_

    dec = SpecDecoder(target, head, TreeConfig(3, 2, 6), max_batch=4, max_seq_len=256,
                      disable_by_batch_size=2)
    seqs = [Sequence_(p, SamplingParams(), n, set()) for p, n in zip(prompts, lengths)]
    dec.add_many(seqs)
    kinds = []
    while dec.seqs:
        batch = len(dec.seqs)
        dec.step()
        kinds.append((batch, dec.last_round_plain))
    assert [s.output for s in seqs] == plain
    assert all(plain_round == (batch > 2) for batch, plain_round in kinds)
    assert dec.stats.plain_rounds == sum(p for _, p in kinds) > 0 and dec.stats.rounds > 0
    assert sum(len(s.accepted) for s in seqs) == dec.stats.row_rounds  # speculative rounds only
    with pytest.raises(UserError, match="disable_by_batch_size"):
        SpecDecoder(target, head, TreeConfig(3, 2, 6), disable_by_batch_size=-1)


@pytest.mark.parametrize("greedy", [True, False])
def test_batch_tree_shrinks_the_tree_as_the_batch_grows_and_stays_identical(greedy):
    """With batch_tree (3, a smaller tree) rounds of 3 or more sequences draft and verify the
    smaller tree and the rest the decoder's own; where the batch crosses 3 the next round drafts
    its tree anew (the ones drafted ahead are the other tree's). Greedy output is still plain
    decoding's, sampled rounds run both trees too, and the n-gram branch (the large tree's only)
    keeps its history through the small tree's rounds."""
    target, head, prompts, lengths, plain = staggered_jobs()
    from eagle_infer.speculative import Sequence_

    big, small = TreeConfig(3, 2, 6, ngram_branch=2), TreeConfig(1, 2, 3)
    dec = SpecDecoder(target, head, big, max_batch=4, max_seq_len=256, batch_tree=(3, small))
    assert dec.max_pending == big.slots_past_end and dec.ahead_tree.tokens.shape == (4, 6)
    params = SamplingParams() if greedy else SamplingParams(temperature=1.0, seed=5)
    seqs = [Sequence_(p, params, n, set()) for p, n in zip(prompts, lengths)]
    dec.add_many(seqs)
    trees = []
    while dec.seqs:
        batch = len(dec.seqs)
        dec.step()
        trees.append((batch, dec.round_tree))
        for b, seq in enumerate(dec.seqs):  # each row's tokens so far, the root last
            assert dec.history[b, :len(seq.prompt) + len(seq.output)].tolist() == seq.prompt + seq.output
    assert all(t is (small if b >= 3 else big) for b, t in trees), trees
    assert {b for b, _ in trees} == {1, 2, 3, 4}
    if greedy:
        assert [s.output for s in seqs] == plain
    assert [len(s.output) for s in seqs] == lengths
    with pytest.raises(UserError, match="batch tree"):
        SpecDecoder(target, head, big, batch_tree=(1, small))


def test_plain_rounds_defer_the_heads_catch_up():
    """Rounds without drafts leave the head's catch-up for one forward over the pending pairs
    (when max_pending pile up, and before speculation resumes): its cache, root feature and
    draft log-probs then equal those of a head that saw the whole sequence at once (a join's
    prefill over prompt + output), so drafting resumes as if it had kept up every round."""
    target = tiny_target(layers=2)
    head = random_head(target, "eagle3", draft_vocab=50)
    prompts = prompts_for(target.config.vocab_size, lens=(5, 11))
    plain = [generate(target, [p], 40)[0] for p in prompts]  # before the decoder: generate resets the caches
    from eagle_infer.speculative import Sequence_

    dec = SpecDecoder(target, head, TreeConfig(3, 2, 6), max_batch=2, max_seq_len=128,
                      disable_by_batch_size=0)
    assert dec.max_pending == 12
    seqs = [Sequence_(p, SamplingParams(), 40, set()) for p in prompts]
    dec.add_many(seqs)
    flushed = []
    for _ in range(29):  # 28 tokens after the first: two full buffers, then 5 pairs pending
        dec.step()
        flushed.append(int(dec.pending_n[0]))
    assert dec.stats.plain_rounds == 29 and dec.stats.rounds == 0
    assert flushed.count(0) == 2 and [s.pending for s in seqs] == [5, 5] == dec.pending_n.tolist()
    dec._catch_up_pending(2, dec._catch_up)
    assert dec.pending_n.tolist() == [0, 0] and [s.pending for s in seqs] == [0, 0]
    assert [s.output for s in seqs] == [o[:30] for o in plain]
    for b, seq in enumerate(seqs):
        twin_target = tiny_target(layers=2)  # the same weights, their own caches
        twin = random_head(twin_target, "eagle3", draft_vocab=50)
        ref = SpecDecoder(twin_target, twin, TreeConfig(3, 2, 6), max_batch=1, max_seq_len=128)
        ref.add(Sequence_(seq.prompt + seq.output[:-1], SamplingParams(), 5, set()))
        L = int(dec.L[b])
        assert L == int(ref.L[0]) and int(dec.root[b]) == int(ref.root[0]) == seq.output[-1]
        torch.testing.assert_close(dec.root_g[b], ref.root_g[0], atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(dec.root_logp[b], ref.root_logp[0], atol=1e-4, rtol=1e-4)
        kv, kv_ref = head.layer.self_attn.cache.kv, twin.layer.self_attn.cache.kv
        torch.testing.assert_close(kv[:, :, b, :, :L], kv_ref[:, :, 0, :, :L], atol=1e-4, rtol=1e-4)
    # speculation resumes from the caught-up head: rounds draft again, still plain decoding's output
    dec.disable_by_batch_size = None
    while dec.seqs:
        dec.step()
    assert dec.stats.rounds > 0
    assert [s.output for s in seqs] == plain


@pytest.mark.parametrize("settings,disable,ngram,repeating", [
    (dict(temperature=1.0), None, 0, False), (dict(temperature=0.8, top_k=5), None, 0, False),
    (dict(temperature=1.2, top_p=0.7), None, 0, False), (dict(temperature=1.0), 0, 0, False),
    (dict(temperature=1.0), None, 3, False), (dict(temperature=1.0), None, 3, True),
    (dict(temperature=0.9, min_p=0.15), None, 0, False),
    (dict(temperature=1.0, frequency_penalty=2.0, presence_penalty=2.0, repetition_penalty=2.0),
     None, 3, True),
    (dict(temperature=1.0, allowed_token_ids=list(range(1, 12)), bad_words=[[t, t] for t in range(12)]),
     None, 3, True),
    (dict(temperature=1.0, grammar="pairs"), None, 3, True),
    (dict(temperature=1.0, grammar="forced"), None, 3, True),
], ids=["t1", "topk", "topp", "t1-plain", "t1-ngram", "t1-ngram-repeating", "minp", "t1-penalties",
        "t1-bad-words", "t1-grammar", "t1-grammar-forced"])
def test_sampling_matches_target_distribution(settings, disable, ngram, repeating):
    """The 2nd and 3rd tokens (the first produced by tree verification) follow the target's
    exact marginal distribution (chi-square, p > 0.01), and the 3rd repeats the 2nd as often as
    the target says (binomial); also where every round is a plain round (disable_by_batch_size 0:
    the root alone, its bonus drawn from the target), with an n-gram branch (the prompt's tokens
    recur in 12: its chain, a deterministic draft too, often repeats a token of the draft's, a
    second child of the same token, which must never be accepted once the first is rejected:
    on a target that repeats its last token, trying it again made 95% repeats of 81%), and with
    penalties, on a target that likes to repeat its
    last token (the 3rd token's node then must count the 2nd, drafted in the same round: counted
    from the round's start alone, 1,564 repeats in 6,000 where ~100 are right), and with vLLM's
    allowed_token_ids and bad_words there (every repeat barred: none may happen), and with a
    grammar whose next token depends on the last (pair_grammar: no repeats either), or that
    forces "56" after a digit 0-4 (rounds draft it: Grammar.encode)."""
    V = 12
    settings = dict(settings)
    grammar = {None: None, "pairs": pair_grammar(V, V - 1),
               "forced": replace(pair_grammar(V, V - 1, "([0-4]56|[5-9][5-9])+"), encode=digits),
               }[settings.pop("grammar", None)]
    target = tiny_target(vocab=V, layers=1, seed=5, silent=repeating)
    if repeating:  # the next token depends on the last alone, and most likely repeats it
        with torch.no_grad():
            target.lm_head.weight.copy_(0.15 * target.embed_tokens.weight)
    head = oracle_head(target, noise=0.5)
    prompt = [1, 4, 7]
    n = 6000  # 1500 was one fixed draw whose top-k case sat at p = 0.008 (40k draws per root: exact)
    params = [SamplingParams(seed=1000 + i, grammar=grammar, **settings) for i in range(n)]
    outs = []
    batch = 250
    dec = SpecDecoder(target, head, TreeConfig(3, 3, 8, ngram), max_batch=batch, max_seq_len=64,
                      disable_by_batch_size=disable)
    for i in range(0, n, batch):
        outs += generate_speculative(target, head, [prompt] * batch, 3, params[i:i + batch],
                                     tree=dec.tree, decoder=dec)[0]
    assert_follows_target(target, prompt, outs, params[0], grammar)


def assert_follows_target(target: Transformer, prompt: list[int], outs: list[list[int]],
                          params: SamplingParams, grammar=None) -> None:
    """Three sampled tokens after `prompt` in each of outs: the 2nd and the 3rd follow the
    target's exact marginals under params (chi-square, p > 0.01), the 3rd repeats the 2nd as
    often as the target says (binomial)."""
    V, n = target.config.vocab_size, len(outs)
    # Exact marginals from the target: p(t1) p(t2|t1) p(t3|t1,t2).
    p = dict(temperature=params.temperature, top_p=params.top_p, top_k=params.top_k, min_p=params.min_p)

    def dist(ctx):
        logits, _ = target_logits(target, ctx)
        matcher = None
        if grammar is not None:
            from eagle_infer.grammar import new_matcher

            matcher = new_matcher(grammar)
            assert all(matcher.accept_token(t) for t in ctx[len(prompt):])
        logits = penalize(logits[None, None], [params], [prompt], [ctx[len(prompt):]], [set()],
                          matchers=[matcher])[0, 0]
        return logits_to_probs(logits, **p)

    p1 = dist(prompt)
    p2 = torch.zeros(V)
    p3 = torch.zeros(V)
    repeat = 0.0  # P(t3 = t2): where a round accepted t2, its node's logits gave t3
    for a in range(V):
        if p1[a] == 0:
            continue
        pa = dist(prompt + [a])
        p2 += p1[a] * pa
        for b in range(V):
            if pa[b] > 0:
                pab = dist(prompt + [a, b])
                p3 += p1[a] * pa[b] * pab
                repeat += float(p1[a] * pa[b] * pab[b])
    repeats = sum(o[1] == o[2] for o in outs)
    assert binomtest(repeats, n, repeat).pvalue > 0.01, (repeats, n * repeat)
    for pos, expect in ((1, p2), (2, p3)):
        counts = torch.bincount(torch.tensor([o[pos] for o in outs]), minlength=V).double()
        keep = expect > 0
        assert counts[~keep].sum() == 0, "sampled a token the target gives zero probability"
        exp = expect[keep].double() * n
        # Merge rare cells so the chi-square approximation holds.
        order = exp.argsort()
        obs_s, exp_s = counts[keep][order], exp[order]
        small = exp_s.cumsum(0) < 25
        obs = torch.cat([obs_s[small].sum()[None], obs_s[~small]]) if small.any() else obs_s
        exp_c = torch.cat([exp_s[small].sum()[None], exp_s[~small]]) if small.any() else exp_s
        if len(obs) < 2:  # one token takes all the mass (top-p): the zero-probability check holds it
            continue
        stat = chisquare(obs.numpy(), exp_c.numpy() * obs.sum().item() / exp_c.sum().item())
        assert stat.pvalue > 0.01, (pos, stat)


def target_logits(target: Transformer, ctx: list[int]):
    from eagle_infer.generate import ensure_cache, prefill

    ensure_cache(target, 1, 64)
    logits, hidden = prefill(target, [ctx])
    return logits[0], hidden


def test_spec_stats_histogram_merges_and_gives_tau_and_rates():
    a, b = SpecStats(rounds=2), SpecStats(rounds=1)
    for k in (0, 2, 3):
        a.record(k)
    b.record(2)
    b.record(5)
    a.merge(b)
    assert a.rounds == 3 and a.accepted_hist == [1, 0, 2, 1, 0, 1]
    assert a.row_rounds == 5 and a.accepted_tokens == 12
    assert a.acceptance_length() == 1 + 12 / 5
    # reached position 1: 4 of 5; position 2: 4 of 4; position 3: 2 of 4; 4: 1 of 2; 5: 1 of 1
    assert a.accept_rate_per_position(6) == [4 / 5, 1.0, 0.5, 0.5, 1.0, 0.0]
    assert SpecStats().acceptance_length() == 1.0


def test_join_groups_partition_by_length_with_bounded_padding():
    from eagle_infer.generate import join_groups

    lengths = [40, 60, 80, 50, 70, 90, 30, 64, 500, 7]
    groups = join_groups(lengths)
    assert sorted(i for g in groups for i in g) == list(range(len(lengths)))
    for g in groups:
        real = sum(lengths[i] for i in g)
        assert max(lengths[i] for i in g) * len(g) <= 1.1 * real
    assert [500] in [[lengths[i] for i in g] for g in groups]  # a long prompt does not pad short ones
    assert len(groups) < len(lengths)  # similar lengths do share a forward
    assert join_groups([]) == []


def test_join_groups_respect_row_and_token_limits():
    from eagle_infer.generate import join_groups

    lengths = [100] * 10 + [300] * 3
    assert max(len(g) for g in join_groups(lengths)) == 10  # equal lengths: no padding, one group
    groups = join_groups(lengths, max_rows=4, max_tokens=700)
    assert sorted(i for g in groups for i in g) == list(range(len(lengths)))
    assert all(len(g) <= 4 and max(lengths[i] for i in g) * len(g) <= 700 for g in groups)
    assert [len(g) for g in groups] == [4, 4, 2, 2, 1]
