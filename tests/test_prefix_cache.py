"""Prefix caching: a prompt that starts with tokens a cache row holds takes those slots over and
prefills only the rest. The caches it leaves (the target's, and a speculative decoder's head's)
equal a fresh prefill's, so decoding goes on exactly as without it."""

from __future__ import annotations

import copy

import pytest
import torch

from eagle_infer.engine import PlainDecoder
from eagle_infer.generate import generate
from eagle_infer.prefix_cache import MIN_HIT, PINNED, Held, PrefixRows, shared_prefix
from eagle_infer.sampling import SamplingParams
from eagle_infer.speculative import Sequence_, SpecDecoder
from eagle_infer.tree import TreeConfig
from tests.test_speculative import random_head, tiny_target

torch.set_num_threads(1)


def decoder(kind: str, target, prefix_cache: bool, max_batch: int = 1):
    if kind == "plain":
        return PlainDecoder(target, max_batch=max_batch, max_seq_len=256, prefix_cache=prefix_cache)
    head = random_head(target, kind, draft_vocab=50 if kind == "eagle3" else None)
    return SpecDecoder(target, head, TreeConfig(3, 2, 6, ngram_branch=2), max_batch=max_batch,
                       max_seq_len=256, prefix_cache=prefix_cache)


def run(dec, seqs: list[Sequence_]) -> None:
    dec.add_many(seqs)
    while dec.seqs:
        dec.step()


def ids(n: int, seed: int, vocab: int = 96) -> list[int]:
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def seq(prompt: list[int], n: int, params: SamplingParams | None = None) -> Sequence_:
    return Sequence_(prompt, params or SamplingParams(), n, set())


def test_shared_prefix_and_the_slots_a_row_gives():
    assert shared_prefix([1, 2, 3], [1, 2, 4, 5]) == 2 and shared_prefix([1, 2], [1, 2, 3]) == 2
    assert shared_prefix([], [1]) == 0
    plain, spec = PrefixRows(0), PrefixRows(1)
    # a row of 40 slots written (its tokens: those 40 and the next one, not yet in the cache)
    tokens = list(range(41))
    assert plain.held_by(tokens, 40).valid == 40 and spec.held_by(tokens, 40, pending=3).valid == 37
    assert spec.held_by(tokens[:39], 40).valid == 38  # the head pairs slot i with token i + 1
    held = Held(tokens, 40)
    assert plain.reusable(held, tokens[:30] + [99]) == 30
    assert spec.reusable(held, tokens[:30] + [99]) == 29  # slot 29's pair reads token 30
    assert plain.reusable(held, tokens[:20]) == 19  # one prompt token is always prefilled again
    assert plain.reusable(held, tokens + [7, 8]) == 40
    rows = {0: Held(tokens[:10] + [50] * 30, 40), 3: held}
    assert plain.best(tokens[:30] + [99], rows) == (3, 30)
    assert plain.best(tokens[:30] + [99], rows, row_ok=lambda r: r != 3) == (None, 0)  # row 0: < MIN_HIT
    assert plain.best(tokens[:MIN_HIT] + [99], rows) == (3, MIN_HIT)
    # where a row's slots go before a new sequence overwrites them: an empty free row, else the
    # least recent one, if it is older
    for row in (0, 1, 2):
        plain.keep(row, Held(tokens, 40))
    assert plain.spare_for(0, [1, 2, 3]) == 3 and plain.spare_for(5, [1, 2]) is None
    assert plain.spare_for(2, [0, 1]) == 0 and plain.spare_for(0, [1, 2]) is None


def whole_prefill(dec, prompt: list[int], n: int) -> tuple[PlainDecoder | SpecDecoder, Sequence_]:
    """A decoder without a prefix cache, on copies of dec's target and head (a decoder sets up
    the caches of the models it is given), that prefilled `prompt` whole into row 0."""
    target = copy.deepcopy(dec.target)
    if isinstance(dec, PlainDecoder):
        fresh = PlainDecoder(target, max_batch=1, max_seq_len=dec.max_seq_len)
    else:
        fresh = SpecDecoder(target, copy.deepcopy(dec.head), dec.tree, max_seq_len=dec.max_seq_len)
    alone = seq(prompt, n)
    fresh.add(alone)
    return fresh, alone


def caches(dec, row: int, n: int) -> list[torch.Tensor]:
    models = [dec.target] + ([dec.head] if isinstance(dec, SpecDecoder) else [])
    return [m.cache.kv[:, :, row, :, :n].clone() for m in models]


@pytest.mark.parametrize("kind", ["plain", "eagle2", "eagle3"])
def test_a_next_turn_takes_over_the_last_answer_and_decodes_as_a_fresh_prefill(kind):
    """A chat's next turn: its prompt is the last prompt, the last answer and more. The row the
    last sequence left holds them: the new prompt prefills only past them, its caches (the
    target's; the head's pairs and next-root state) equal those of a decoder without a prefix
    cache, and its greedy output equals plain greedy decoding's."""
    target = tiny_target(layers=2)
    first = seq(ids(30, 1), 20)
    dec = decoder(kind, target, prefix_cache=True)
    run(dec, [first])
    turn = first.prompt + first.output[:-2] + ids(7, 2)  # the answer's tail re-tokenized apart
    second = seq(turn, 25)
    lookahead = 0 if kind == "plain" else 1
    hit = min(len(first.prompt) + len(first.output) - 2 - lookahead, first.cached - first.pending)
    assert dec.rows.left_to_prefill(second) == len(turn) - hit  # what chunked prefill weighs
    dec.add(second)
    assert second.prefix_hit == hit
    assert second.prefix_hit >= MIN_HIT
    fresh, alone = whole_prefill(dec, turn, 25)
    assert fresh.target.cache is not dec.target.cache
    assert alone.prefix_hit == 0 and alone.output == second.output
    n = len(turn)
    for ours, ref in zip(caches(dec, 0, n), caches(fresh, 0, n)):
        torch.testing.assert_close(ours, ref, atol=1e-5, rtol=1e-5)
    if kind != "plain":
        for name in ("L", "root", "root_g", "root_logp"):
            torch.testing.assert_close(getattr(dec, name)[0], getattr(fresh, name)[0], atol=1e-5, rtol=1e-5)
        assert dec.history[0, :n + 1].tolist() == fresh.history[0, :n + 1].tolist()
    while dec.seqs:
        dec.step()
    assert second.output == generate(target, [turn], 25)[0]
    assert dec.rows.prefix.hits == second.prefix_hit
    assert dec.rows.prefix.queries == len(first.prompt) + len(turn)


@pytest.mark.parametrize("kind", ["plain", "eagle3"])
def test_rows_that_leave_out_of_order_keep_their_slots_and_active_rows_share_theirs(kind):
    """Three rows; sequences finish in another order than they joined, so leaving rows swap with
    the last active one. Each later prompt extends an earlier sequence's (a free row's, swapped
    in) or an active one's prompt (copied): every hit is taken, and every output is plain greedy
    decoding's. Without a prefix cache nothing is taken and the outputs are the same."""
    target = tiny_target(layers=2)
    base = [ids(24 + 3 * i, 10 + i) for i in range(3)]
    lengths = [30, 4, 12]
    outputs = {}
    for prefix_cache in (True, False):
        dec = decoder(kind, target, prefix_cache, max_batch=3)
        firsts = [seq(p, n) for p, n in zip(base, lengths)]
        run(dec, firsts)
        if prefix_cache:  # the second left first, from row 1: it swapped with row 2, the last
            held = dec.rows.prefix.held
            assert [held[r].tokens for r in range(3)] == [s.prompt + s.output for s in
                                                          (firsts[0], firsts[2], firsts[1])]
        later = [seq(firsts[1].prompt + firsts[1].output + ids(5, 20), 16),  # row 2's, into row 0
                 seq(firsts[0].prompt + firsts[0].output[:10] + ids(3, 21), 8)]  # then row 2's
        dec.add_many(later)  # hits join alone, each swapping its row in
        extra = seq(later[0].prompt[:22] + ids(4, 22), 6)  # an active row's prompt
        dec.add(extra)
        while dec.seqs:
            dec.step()
        for s in later + [extra]:
            assert s.output == generate(target, [s.prompt], s.max_new_tokens)[0]
        hits = [s.prefix_hit for s in later + [extra]]
        if prefix_cache:
            assert all(h >= MIN_HIT for h in hits), hits
            assert hits[2] == 22 - (kind != "plain")  # copied from later[0]'s active row
        else:
            assert hits == [0, 0, 0]
        outputs[prefix_cache] = [s.output for s in firsts + later + [extra]]
    assert outputs[True] == outputs[False]


def test_a_lone_join_beside_a_group_and_prompt_logprobs_prefill_everything():
    """Sequences joining together: a hit joins alone and first, the others as one group (which
    take nothing, even where a prefix would fit). A sequence that asks for prompt logprobs scores
    every prompt token, so it prefills its whole prompt."""
    target = tiny_target(layers=2)
    dec = decoder("eagle3", target, True, max_batch=4)
    first = seq(ids(30, 1), 10)
    run(dec, [first])
    hit = seq(first.prompt + first.output + ids(4, 3), 6)
    misses = [seq(ids(20, 4), 6), seq(ids(21, 5), 6)]
    scored = seq(first.prompt + ids(3, 6), 6)
    scored.prompt_logprobs = 1
    run(dec, misses + [hit, scored])
    assert hit.prefix_hit >= MIN_HIT and [s.prefix_hit for s in misses + [scored]] == [0, 0, 0]
    assert len(scored.prompt_token_logprobs) == len(scored.prompt) - 1
    for s in misses + [hit, scored]:
        assert s.output == generate(target, [s.prompt], 6)[0]


def test_sampled_output_with_a_prefix_taken_over_is_the_same_draws():
    """Seeded sampling: a row that took its prefix over samples the same tokens as one prefilled
    whole (the same distributions and each request's own generator)."""
    target = tiny_target(layers=2)
    first = seq(ids(30, 1), 12)
    params = SamplingParams(temperature=1.0, seed=7)
    outs = []
    for prefix_cache in (True, False):
        dec = decoder("eagle3", target, prefix_cache)
        dec.head.load_state_dict(random_head(target, "eagle3", draft_vocab=50).state_dict())
        run(dec, [seq(first.prompt, 12)])
        again = seq(first.prompt + ids(6, 2), 30, params)
        run(dec, [again])
        assert (again.prefix_hit > 0) == prefix_cache
        outs.append(again.output)
    assert outs[0] == outs[1]


def test_longrope_rows_share_only_with_the_same_factors(tiny_model_dir):
    """Phi-3's LongRoPE turns a sequence with one set of factors (long where it may pass the
    original context): a prompt takes over a row written with the same set, never another."""
    from eagle_infer.loader import load_model

    target = load_model(tiny_model_dir("phi3"), "fp32", "cpu")
    original = target.config.long_rope_from()
    dec = PlainDecoder(target, max_batch=1, max_seq_len=256, prefix_cache=True)
    first = seq(ids(40, 1, target.config.vocab_size), 8)
    run(dec, [first])
    turn = first.prompt + first.output + ids(5, 2, target.config.vocab_size)
    far = seq(turn, original)  # may pass the original context: long factors
    run(dec, [far])
    assert far.prefix_hit == 0 and far.output == generate(target, [turn], original)[0]
    near = seq(turn + far.output[:3], 8)  # within it: short, the first row's set, which far overwrote
    run(dec, [near])
    assert near.prefix_hit == 0
    near2 = seq(near.prompt + near.output + [1, 2], 8)
    run(dec, [near2])
    assert near2.prefix_hit >= MIN_HIT and near2.output == generate(target, [near2.prompt], 8)[0]


def test_a_row_left_by_rounds_without_drafts_gives_only_what_the_head_caught_up_on():
    """Rounds without drafts (more sequences than disable_by_batch_size) leave the head's catch-up
    for later: a sequence that finishes among them leaves slots the head has not written. A prompt
    that extends it takes over only what the head holds, and its caches equal a fresh prefill's."""
    target = tiny_target(layers=2)
    head = random_head(target, "eagle3", draft_vocab=50)
    dec = SpecDecoder(target, head, TreeConfig(3, 2, 6), max_batch=3, max_seq_len=256, prefix_cache=True,
                      disable_by_batch_size=1)
    firsts = [seq(ids(30, 1), 6), seq(ids(26, 2), 20), seq(ids(28, 3), 20)]
    run(dec, firsts)
    left = firsts[0]
    assert left.pending > 1  # it left with pairs the head had not caught up on
    turn = left.prompt + left.output + ids(3, 4)
    later = seq(turn, 8)
    dec.add(later)
    assert later.prefix_hit == left.cached - left.pending >= MIN_HIT
    fresh, _ = whole_prefill(dec, turn, 8)
    for ours, ref in zip(caches(dec, 0, len(turn)), caches(fresh, 0, len(turn))):
        torch.testing.assert_close(ours, ref, atol=1e-5, rtol=1e-5)
    while dec.seqs:
        dec.step()
    assert later.output == generate(target, [turn], 8)[0]


@pytest.mark.parametrize("kind", ["plain", "eagle3"])
def test_free_rows_keep_the_latest_sequences_for_their_next_turns(kind):
    """One conversation at a time over three rows (a server at concurrency 1): each new prompt
    joins at row 0, and what row 0 held moves to a free row first (one that holds nothing, else
    the least recent sequence's), so the last three conversations each find their history for
    a next turn, the oldest is gone, and every output is plain greedy decoding's."""
    target = tiny_target(layers=2)
    dec = decoder(kind, target, True, max_batch=3)
    talks = [seq(ids(20 + i, 30 + i), 8) for i in range(4)]
    for s in talks:
        run(dec, [s])
        assert s.prefix_hit == 0
    held = dec.rows.prefix.held.values()
    assert sorted(h.tokens[0] for h in held) == sorted(s.prompt[0] for s in talks[1:])
    for i in (1, 3, 2, 0):  # the next turns, in another order
        turn = seq(talks[i].prompt + talks[i].output + ids(3, 40 + i), 8)
        run(dec, [turn])
        assert (turn.prefix_hit >= MIN_HIT) == (i != 0), (i, turn.prefix_hit)
        assert turn.output == generate(target, [turn.prompt], 8)[0]


@pytest.mark.parametrize("kind", ["plain", "eagle3"])
def test_sequences_arriving_together_with_one_prefix_prefill_it_once(kind):
    """A burst of prompts that start alike (n choices of a prompt, questions about one document)
    arriving with others: the first of them and the others join as a group; the rest each take
    the shared prefix over from the first one's running row, and answer as plain greedy does."""
    target = tiny_target(layers=2)
    dec = decoder(kind, target, True, max_batch=5)
    doc = ids(40, 50)
    seqs = [seq(doc + ids(4, 51), 6), seq(ids(30, 52), 6), seq(doc + ids(6, 53), 6), seq(doc, 6),
            seq(doc + ids(2, 54), 6)]
    run(dec, seqs)
    lookahead = kind != "plain"
    assert [s.prefix_hit for s in seqs] == [0, 0, 40 - lookahead, 39, 40 - lookahead]
    for s in seqs:
        assert s.output == generate(target, [s.prompt], 6)[0]
    assert dec.rows.prefix.hits == 3 * 40 - 1 - 2 * lookahead


@pytest.mark.parametrize("kind", ["plain", "eagle3"])
@pytest.mark.parametrize("source", ["free", "active"])
def test_chunks_start_past_the_prefix_a_row_holds(kind, source):
    """Chunked prefill of a prompt that starts with what a row holds (a chat's next turn over a
    chunk long, a shared system prompt): its first chunk starts past that prefix, taken from a
    free row (swapped into the chunk row) or an active one (copied), and counted as a cache hit;
    its caches after the join equal a whole prefill's and its output is plain greedy decoding's."""
    target = tiny_target(layers=2)
    dec = decoder(kind, target, True, max_batch=3)
    first = seq(ids(40, 70), 8)
    if source == "free":
        run(dec, [first])  # it left: a free row holds its prompt and answer
    else:
        dec.add(first)
        dec.step()  # decoding, its prompt in its row
    held = dec.rows.prefix_hint(seq(first.prompt + ids(60, 71), 1))
    assert held >= 30
    nxt = seq(first.prompt + ids(60, 71), 6)
    starts = []
    while dec.rows.left_to_prefill(nxt) > 24:
        starts.append(dec.rows.prefilled(nxt))
        dec.prefill_chunk(nxt, 24)
    assert starts[0] == 0 and dec.rows.prefilled(nxt) == held + 24 * len(starts), starts
    hits = dec.rows.prefix.hits
    dec.add(nxt)
    assert nxt.prefix_hit == held and dec.rows.prefix.hits == hits + held
    fresh, _ = whole_prefill(dec, nxt.prompt, 6)
    row = dec.seqs.index(nxt)
    for ours, ref in zip(caches(dec, row, len(nxt.prompt)), caches(fresh, 0, len(nxt.prompt))):
        torch.testing.assert_close(ours, ref, atol=1e-5, rtol=1e-5)
    while dec.seqs:
        dec.step()
    assert nxt.output == generate(target, [nxt.prompt], 6)[0]
    assert first.output == generate(target, [first.prompt], 8)[0]


@pytest.mark.parametrize("kind", ["plain", "eagle3"])
def test_a_long_prompt_prefilled_in_chunks_between_rounds_joins_as_if_whole(kind, monkeypatch):
    """Chunked prefill: a long prompt's chunks go into a free row between the rounds of a running
    sequence (which keeps decoding), a join in between moves the row aside, and the prompt then
    joins taking its chunks over: its caches equal a whole prefill's, and both outputs are plain
    greedy decoding's. A row overwritten before the join starts the chunks again."""
    target = tiny_target(layers=2)
    dec = decoder(kind, target, True, max_batch=3)
    running = seq(ids(12, 60), 40)
    dec.add(running)
    long = seq(ids(100, 61), 10)
    written = []
    while dec.rows.left_to_prefill(long) > 24:
        written.append(dec.prefill_chunk(long, 24))
        dec.step()
        if len(written) == 2:  # another joins and leaves: the chunks' row moves aside, kept
            other = seq(ids(10, 62), 2)
            dec.add(other)
            dec.step()
    assert written == [24, 48, 72, 96]
    hits, starts = dec.rows.prefix.hits, []
    import eagle_infer.engine
    import eagle_infer.speculative

    def spy(*args, **kw):
        starts.append(kw["start"] if "start" in kw else args[5])
        return prefill_rows(*args, **kw)

    prefill_rows = eagle_infer.speculative.prefill_rows
    for module in (eagle_infer.engine, eagle_infer.speculative):
        monkeypatch.setattr(module, "prefill_rows", spy)
    dec.add(long)
    assert starts == [[96]]  # the join prefills the last 4 tokens
    assert long.prefix_hit == 0 and dec.rows.prefix.hits == hits  # its own chunks: no cache hit
    fresh, _ = whole_prefill(dec, long.prompt, 10)
    row = dec.seqs.index(long)
    for ours, ref in zip(caches(dec, row, 100), caches(fresh, 0, 100)):
        torch.testing.assert_close(ours, ref, atol=1e-5, rtol=1e-5)
    while dec.seqs:
        dec.step()
    assert long.output == generate(target, [long.prompt], 10)[0]
    assert running.output == generate(target, [running.prompt], 40)[0]
    # overwritten before its join: prefilled() says so, and the chunks start again
    again = seq(ids(100, 63), 4)
    assert dec.prefill_chunk(again, 24) == 24 and dec.rows.prefilled(again) == 24
    dec.add_many([seq(ids(10, 64 + i), 2) for i in range(3)])  # every row, the pinned one too
    assert dec.rows.prefilled(again) == 0
    while dec.seqs:
        dec.step()
    assert dec.prefill_chunk(again, 24) == 24
    # cancelled before its join (its client gone): its chunks stay as a free row's, unpinned
    pinned = dec.rows.prefix.held[dec.rows.prefix.row_of(again.partial)]
    assert pinned.left == PINNED
    dec.cancel(again)
    assert pinned.left != PINNED and dec.rows.prefilled(again) == 24 and again.done
