"""kernels/avx2_attention: attention of a few query rows over the KV cache, fp32 and bf16 on AVX2
(bf16 on AMX tiles where the CPU has them). It computes SDPA (GQA, additive masks with -inf,
cache views read in place), a row's output does not depend on the rows beside it or on masked
slots, model.attention hands it decode and verify calls (eager and compiled) only while enabled,
and greedy speculative decoding on it is token-identical to plain decoding on it. Its second op,
causal_attention (a prefill's), computes SDPA's causal attention over the first T slots."""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.nn.functional as F
from test_speculative import prompts_for, random_head

from eagle_infer.generate import generate
from eagle_infer.kernels import avx2_attention, avx2_linear
from eagle_infer.model import ModelConfig, Transformer, attention
from eagle_infer.speculative import generate_speculative
from eagle_infer.tree import TreeConfig

pytestmark = pytest.mark.skipif(not avx2_linear.supported(), reason="CPU without AVX2 / FMA")


def cache_views(B: int, KVH: int, S: int, max_len: int = 600, dtype: torch.dtype = torch.float32,
                D: int = 64) -> tuple[torch.Tensor, torch.Tensor]:
    """keys, values [B, KVH, S, D]: strided views of a [2, B, KVH, max_len, D] cache, as a layer's."""
    cache = torch.randn(2, B, KVH, max_len, D).to(dtype)
    return cache.narrow(3, 0, S).unbind(0)


def tree_bias(B: int, T: int, S: int) -> torch.Tensor:
    """[B, 1, T, S] additive: every slot before the last T, then a tree of ancestors in the last T
    (node t sees itself and node (t - 1) // 2), and one masked slot in the prefix of row 1."""
    bias = torch.zeros(B, 1, T, S)
    bias[..., S - T:] = float("-inf")
    for t in range(T):
        node = t
        while True:
            bias[:, :, t, S - T + node] = 0
            if node == 0:
                break
            node = (node - 1) // 2
    if B > 1:
        bias[1, :, :, 2] = float("-inf")
    return bias


@pytest.fixture
def multiply(request):
    """The kernel's bf16 scores for one test ("loops": AVX2 FMAs, "dot": vdpbf16ps, "amx": tiles),
    then back."""
    was = avx2_attention.bf16_scores()
    if avx2_attention.set_bf16_scores(request.param) != request.param:
        avx2_attention.set_bf16_scores(was)
        pytest.skip(f"CPU without {request.param} (AVX512-BF16; AMX tiles Linux lets this process use)")
    yield request.param
    avx2_attention.set_bf16_scores(was)


# (1, 7): fewer slots than a block; (16, 300) and (20, 300): 48 and 60 rows a kv head, more than
# one block of 16 rows on the tiles; (3, 9): rows that do not fill a block
@pytest.mark.parametrize("T,S", [(1, 7), (1, 515), (4, 64), (16, 300), (3, 9), (20, 33)])
@pytest.mark.parametrize("dtype,multiply", [(torch.float32, "loops"), (torch.bfloat16, "loops"),
                                            (torch.bfloat16, "dot"), (torch.bfloat16, "amx")],
                         indirect=["multiply"])
@pytest.mark.parametrize("D", [64, 128, 256])  # Llama's and Qwen2's head size; Qwen3's; Gemma's
def test_kernel_is_sdpa_and_rows_independent(T, S, dtype, multiply, D):
    B, H, KVH = 2, 9, 3
    q = torch.randn(B, T, H, D).to(dtype).transpose(1, 2)  # [B, H, T, D], strided as the model's
    long_keys, long_values = cache_views(B, KVH, S + 15, dtype=dtype, D=D)
    keys, values = long_keys.narrow(2, 0, S), long_values.narrow(2, 0, S)
    bias = tree_bias(B, T, S).to(dtype)
    out = torch.ops.eagle.avx2_attention(q, keys, values, bias)
    # bit for bit with masked slots after the last (a plain step reads fewer slots than a verify)
    # and between (a tree's path has its siblings between its nodes): 15 more slots, 5 of them
    # attended after gaps of odd and even lengths (7, 0, 1, 2, 0), so slots change their place in
    # a block of the kernel's (on AMX tiles: a pair of a tile row, a tile of 16); the short call
    # reads the first S and those 5
    extra = torch.tensor([7, 8, 10, 13, 14]) + S
    gaps = torch.full((B, 1, T, S + 15), float("-inf"), dtype=dtype)
    gaps[..., :S], gaps[..., extra] = bias, 0
    gapped = torch.ops.eagle.avx2_attention(q, long_keys, long_values, gaps)
    idx = torch.cat([torch.arange(S), extra])
    dense = torch.ops.eagle.avx2_attention(q, long_keys[:, :, idx], long_values[:, :, idx], gaps[..., idx])
    assert torch.equal(gapped, dense)
    masked = torch.full((B, 1, T, 15), float("-inf"), dtype=dtype)
    longer = torch.ops.eagle.avx2_attention(q, long_keys, long_values, torch.cat([bias, masked], -1))
    assert torch.equal(longer, out)
    assert out.dtype == dtype
    ref = F.scaled_dot_product_attention(q.double(), keys.double(), values.double(), attn_mask=bias.double(),
                                         enable_gqa=True)
    if dtype == torch.float32:
        torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-5)
    else:  # computed in fp32 (scores on vdpbf16ps or the tiles: bf16 products), one rounding to bf16
        torch.testing.assert_close(out.double(), ref.to(dtype).double(), rtol=8e-3, atol=4e-3)
    for t in range(T):  # bit for bit: a verify's rows = one-row steps'
        one = torch.ops.eagle.avx2_attention(q[:, :, t:t + 1], keys, values, bias[:, :, t:t + 1])
        assert torch.equal(one, out[:, :, t:t + 1]), t


@pytest.mark.parametrize("dtype,multiply", [(torch.float32, "loops"), (torch.bfloat16, "loops"),
                                            (torch.bfloat16, "dot"), (torch.bfloat16, "amx")],
                         indirect=["multiply"])
@pytest.mark.parametrize("D", [64, 128, 256])
def test_a_slot_adds_the_same_wherever_masked_slots_put_it(dtype, multiply, D):
    """A tree's verify reads its path's slots with masked siblings between them, a one-row step
    reads them side by side: the rows' outputs must be the same bits. Peaked scores (queries x 3)
    and ~115,000 outputs, so that a sum whose order depends on where a slot sits shows past the
    bf16 rounding: P V summed 32 slots a tile on AMX failed here (4 outputs differed), as it made
    4 of 8 long prompts' bf16 speculative output part from plain decoding's."""
    torch.manual_seed(0)
    for T, S in ((16, 300), (20, 33), (64, 200)):
        B, H, KVH = 2, 9, 3
        q = (3 * torch.randn(B, T, H, D)).to(dtype).transpose(1, 2)
        long_keys, long_values = cache_views(B, KVH, S + 15, dtype=dtype, D=D)
        extra = torch.tensor([7, 8, 10, 13, 14]) + S  # after gaps of 7, 0, 1, 2 and 0 slots
        gaps = torch.full((B, 1, T, S + 15), float("-inf"), dtype=dtype)
        gaps[..., :S], gaps[..., extra] = 0, 0
        gapped = torch.ops.eagle.avx2_attention(q, long_keys, long_values, gaps)
        idx = torch.cat([torch.arange(S), extra])
        keys, values = long_keys[:, :, idx], long_values[:, :, idx]
        dense = torch.ops.eagle.avx2_attention(q, keys, values, gaps[..., idx])
        assert torch.equal(gapped, dense), (T, S, (gapped != dense).sum().item())


@pytest.mark.parametrize("dtype,multiply", [(torch.float32, "loops"), (torch.bfloat16, "loops"),
                                            (torch.bfloat16, "dot"), (torch.bfloat16, "amx")],
                         indirect=["multiply"])
@pytest.mark.parametrize("D", [64, 128, 256])
@pytest.mark.parametrize("T", [1, 4])
def test_slots_past_a_rows_last_attended_one_are_not_read(dtype, multiply, D, T):
    """A batch's rows share one kv length, the longest row's: a shorter row's tail is masked, and
    the kernel leaves it unread (live_slots). NaN there (a score or a value of NaN would make the
    row NaN, even weighed 0) must not reach the output; each row equals its own call over only the
    slots up to its last attended one, bit for bit, whether that slot ends a block or not."""
    torch.manual_seed(1)
    B, H, KVH, S = 4, 9, 3, 70
    ends = [70, 33, 16, 5]  # one past each row's last attended slot
    q = torch.randn(B, T, H, D).to(dtype).transpose(1, 2)
    keys, values = cache_views(B, KVH, S, dtype=dtype, D=D)
    bias = torch.full((B, 1, T, S), float("-inf"), dtype=dtype)
    for b, end in enumerate(ends):
        bias[b, :, :, :end - T] = 0
        for t in range(T):  # a chain of T new slots at the row's end: each sees those before it
            bias[b, :, t, end - T:end - T + t + 1] = 0
        keys[b, :, end:], values[b, :, end:] = float("nan"), float("nan")
    out = torch.ops.eagle.avx2_attention(q, keys, values, bias)
    assert not out.isnan().any()
    for b, end in enumerate(ends):
        alone = torch.ops.eagle.avx2_attention(q[b:b + 1], keys[b:b + 1, :, :end], values[b:b + 1, :, :end],
                                               bias[b:b + 1, ..., :end].contiguous())
        assert torch.equal(alone, out[b:b + 1]), b


# T: one position; fewer than a block of 8 keys; not a multiple of the 16-position tasks or of
# the 6-row tiles; several tasks (B = 2: a batched prefill, right-padded rows included)
@pytest.mark.parametrize("T", [1, 5, 37, 100])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("D", [64, 128, 256])
# a sliding layer's window: none; 7 and 20 (not multiples of the 8-key blocks or 16-key tiles, a task's
# first rows see keys its last rows do not); longer than T
@pytest.mark.parametrize("window", [0, 7, 20, 200])
def test_causal_kernel_is_causal_sdpa(T, dtype, D, window):
    """causal_attention (a prefill from slot 0) computes SDPA's causal attention over the first T
    slots of cache views (with a window: each position over its `window` latest), reads no slot
    after them (NaN there) nor before a window (NaN there too), takes the model's strided q, and
    returns [B, H, T, D] laid out as [B, T, H, D], which o_proj reads without a copy."""
    avx2_attention.load()
    torch.manual_seed(0)
    B, H, KVH = 2, 9, 3
    q = (2 * torch.randn(B, T, H + 2 * KVH, D)).to(dtype)[:, :, :H].transpose(1, 2)
    keys, values = cache_views(B, KVH, T + 20, dtype=dtype, D=D)
    keys[:, :, T:], values[:, :, T:] = float("nan"), float("nan")
    t = torch.arange(T)
    seen = (t[None] <= t[:, None]) & ((t[None] > t[:, None] - window) if window else True)  # [T, T]
    ref = F.scaled_dot_product_attention(q.double(), keys[:, :, :T].double(), values[:, :, :T].double(),
                                         attn_mask=seen, enable_gqa=True)
    out = torch.ops.eagle.causal_attention(q, keys, values, window)
    assert out.shape == (B, H, T, D) and out.dtype == dtype and out.transpose(1, 2).is_contiguous()
    first = -(-(15 + window) // 16) * 16  # the first 16-position task that sees none of keys 0..15
    if window and first < T:  # those keys are never read there (NaN)
        keys[:, :, :16], values[:, :, :16] = float("nan"), float("nan")
        skipped = torch.ops.eagle.causal_attention(q, keys, values, window)
        assert torch.equal(skipped[:, :, first:], out[:, :, first:])
    if dtype == torch.float32:
        torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-5)
    else:  # computed in fp32, one rounding to bf16
        torch.testing.assert_close(out.double(), ref.to(dtype).double(), rtol=8e-3, atol=4e-3)


@pytest.mark.parametrize("T", [5, 37])
@pytest.mark.parametrize("offset", [13, 64])  # mid a 16-key tile; on one
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("window", [0, 20])
def test_causal_kernel_past_an_offset_is_masked_sdpa(T, offset, dtype, window):
    """causal_attention with an offset (a chunk of a prompt past the slots its row holds):
    position offset + t over slots 0..offset+t (its window's latest), SDPA with that mask, and no
    slot after offset + T read (NaN there)."""
    avx2_attention.load()
    torch.manual_seed(0)
    B, H, KVH, D = 2, 9, 3, 64
    q = (2 * torch.randn(B, T, H + 2 * KVH, D)).to(dtype)[:, :, :H].transpose(1, 2)
    S = offset + T
    keys, values = cache_views(B, KVH, S + 20, dtype=dtype, D=D)
    keys[:, :, S:], values[:, :, S:] = float("nan"), float("nan")
    pos, slot = offset + torch.arange(T), torch.arange(S)
    seen = (slot[None] <= pos[:, None]) & ((slot[None] > pos[:, None] - window) if window else True)
    ref = F.scaled_dot_product_attention(q.double(), keys[:, :, :S].double(), values[:, :, :S].double(),
                                         attn_mask=seen, enable_gqa=True)
    out = torch.ops.eagle.causal_attention(q, keys, values, window, offset)
    assert out.shape == (B, H, T, D) and out.transpose(1, 2).is_contiguous()
    if dtype == torch.float32:
        torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-5)
    else:
        torch.testing.assert_close(out.double(), ref.to(dtype).double(), rtol=8e-3, atol=4e-3)


def test_causal_kernel_names_bad_input():
    avx2_attention.load()
    keys, values = cache_views(1, 3, 10)
    q = torch.randn(1, 9, 4, 64)
    with pytest.raises(RuntimeError, match="fp32 or bf16 only"):
        torch.ops.eagle.causal_attention(q.double(), keys, values)
    with pytest.raises(RuntimeError, match="at least offset \\+ T keys"):
        torch.ops.eagle.causal_attention(torch.randn(1, 9, 11, 64), keys, values)
    with pytest.raises(RuntimeError, match="at least offset \\+ T keys"):
        torch.ops.eagle.causal_attention(q, keys, values, 0, 7)
    with pytest.raises(RuntimeError, match="heads a multiple of kv heads"):
        torch.ops.eagle.causal_attention(torch.randn(1, 8, 4, 64), keys, values)
    with pytest.raises(RuntimeError, match="head size 64, 128 or 256"):
        torch.ops.eagle.causal_attention(torch.randn(1, 9, 4, 96), *cache_views(1, 3, 10, D=96))


@contextlib.contextmanager
def causal_attention_calls():
    """torch.ops.eagle.causal_attention spied on while the block runs: yields the list of its
    calls' (window, offset)."""
    ops, calls = torch.ops.eagle, []

    class Spy:
        def __getattr__(self, name):
            return getattr(ops, name)

        @staticmethod
        def causal_attention(q, keys, values, window=0, offset=0):
            calls.append((window, offset))
            return ops.causal_attention(q, keys, values, window, offset)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(torch.ops, "eagle", Spy())
        yield calls


def test_prefill_runs_the_causal_kernel_only_while_enabled(attention_kernel_on):
    """model.attention(..., causal=True), a prefill from slot 0: the kernel while enabled, else
    SDPA's causal kernel; both the same attention."""
    q, (keys, values) = torch.randn(1, 9, 30, 64), cache_views(1, 3, 40)
    outs, calls = [], []
    for on in (True, False):
        avx2_attention.enable(on)
        with causal_attention_calls() as made:
            outs.append(attention(q, keys, values, torch.zeros(1, 1, 30, 40), True, causal=True))
        calls += made
    assert len(calls) == 1  # the first, enabled, call
    torch.testing.assert_close(outs[0], outs[1], rtol=1e-5, atol=1e-5)


def test_a_prefill_in_chunks_runs_the_causal_kernel_past_each_offset(attention_kernel_on):
    """A prompt prefilled in chunks (generate.prefill with start: chunked prefill, a prefix hit's
    rest) runs each chunk's attention on causal_attention past the slots its row holds (offset),
    and ends with the logits and cache of a whole prefill."""
    from eagle_infer.generate import prefill

    cfg = ModelConfig(model_type="llama", vocab_size=96, hidden_size=192, intermediate_size=64,
                      num_layers=2, num_heads=3, num_kv_heads=1, head_dim=64,
                      max_position_embeddings=512, eos_token_ids=[])
    torch.manual_seed(0)
    model = Transformer(cfg).eval().requires_grad_(False)
    model.setup_cache(1, 256)
    prompt = torch.randint(0, 96, (100,)).tolist()
    whole, _ = prefill(model, [prompt])
    kv = model.cache.kv[..., :100, :].clone()
    model.cache.kv.zero_()
    with causal_attention_calls() as calls:
        for start, end in ((0, 40), (40, 80), (80, 100)):
            logits, _ = prefill(model, [prompt[:end]], start=[start], logits=end == 100)
    assert [offset for _, offset in calls] == [0] * 2 + [40] * 2 + [80] * 2  # two layers a chunk
    torch.testing.assert_close(logits, whole, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(model.cache.kv[..., :100, :], kv, rtol=1e-5, atol=1e-5)


def test_kv_write_runs_in_cpp_once_loaded():
    """The compiled step's cache write (eagle_infer::kv_write): the kernel library registers a C++
    implementation for CPU tensors, which writes what index_copy_ writes and names a bad index
    (the Python one would fail inside index_copy_ with another message)."""
    from eagle_infer.model import kv_write

    avx2_attention.load()
    for dtype in (torch.float32, torch.bfloat16):
        kv = torch.zeros(2, 2, 1, 3, 40, 64, dtype=dtype)
        index = torch.tensor([5, 47, 89, 131, 173, 215])
        new = torch.randn(6, 64).to(dtype)
        kv_write(kv, index, new)
        want = torch.zeros_like(kv)
        want.view(-1, 64).index_copy_(0, index, new)
        assert torch.equal(kv, want)
    with pytest.raises(RuntimeError, match="outside the cache's 480 rows"):
        kv_write(kv, torch.tensor([480]), new[:1])
    with pytest.raises(RuntimeError, match="new \\[n, D\\] of its dtype"):
        kv_write(kv, index, new.float())


def test_kernel_names_bad_input():
    avx2_attention.load()
    keys, values = cache_views(1, 3, 10)
    q = torch.randn(1, 9, 2, 64)
    with pytest.raises(RuntimeError, match="fp32 or bf16 only"):
        torch.ops.eagle.avx2_attention(q.double(), keys, values, torch.zeros(1, 1, 2, 10))
    with pytest.raises(RuntimeError, match="bias .* is not \\[B, 1, T, S\\]"):
        torch.ops.eagle.avx2_attention(q, keys, values, torch.zeros(1, 1, 2, 11))
    with pytest.raises(RuntimeError, match="head size 64, 128 or 256"):
        torch.ops.eagle.avx2_attention(torch.randn(1, 9, 2, 32), keys[..., :32], values[..., :32],
                                       torch.zeros(1, 1, 2, 10))


def test_attention_uses_the_kernel_only_while_enabled(attention_kernel_on):
    q, (keys, values), bias = torch.randn(1, 9, 4, 64), cache_views(1, 3, 40), tree_bias(1, 4, 40)
    graphs = []

    def keep_graph(gm, inputs):
        graphs.append(gm)
        return gm.forward

    for on, rows in ((True, 4), (True, avx2_attention.MAX_ROWS + 1), (False, 4)):
        avx2_attention.enable(on)
        qr, br = q[:, :, :1].expand(1, 9, rows, 64), bias[:, :, :1].expand(1, 1, rows, 40)
        torch._dynamo.reset()
        got = torch.compile(attention, backend=keep_graph, fullgraph=True)(qr, keys, values, br, True)
        torch.testing.assert_close(got, F.scaled_dot_product_attention(qr, keys, values, attn_mask=br,
                                                                       enable_gqa=True), rtol=1e-5, atol=1e-5)
        targets = {n.target for n in graphs[-1].graph.nodes if n.op == "call_function"}
        op = torch.ops.eagle.avx2_attention
        ours = on and rows <= avx2_attention.MAX_ROWS  # a prefill's rows stay on SDPA
        assert bool({op, op.default} & targets) is ours, (on, rows, targets)


def target_for_the_kernel(layers: int = 2, head_dim: int = 64) -> tuple[Transformer, torch.nn.Module]:
    """A tiny fp32 target whose attention the kernel takes (head size 64, or 128 as Qwen3's, its
    query / key norms too), and a random EAGLE-3 head for it."""
    cfg = ModelConfig(model_type="llama", vocab_size=96, hidden_size=128, intermediate_size=128,
                      num_layers=layers, num_heads=4, num_kv_heads=2, head_dim=head_dim,
                      max_position_embeddings=512, eos_token_ids=[], qk_norm=head_dim == 128)
    torch.manual_seed(0)
    target = Transformer(cfg).eval().requires_grad_(False)
    with torch.no_grad():
        target.embed_tokens.weight.normal_(0, 1.0)
        target.lm_head.weight.normal_(0, 0.6)
    return target, random_head(target, "eagle3", draft_vocab=40)


@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_greedy_identical_on_the_kernel_eager_and_compiled(attention_kernel_on, head_dim):
    target, head = target_for_the_kernel(head_dim=head_dim)
    prompts = prompts_for(target.config.vocab_size)
    plain = generate(target, prompts, 20)  # batch 4: every decode step has 4 rows of 1 query
    assert generate(target, prompts, 20, compile=True) == plain
    for tree in (TreeConfig(), TreeConfig(3, 4, 4), TreeConfig.chain(3)):
        spec, _ = generate_speculative(target, head, prompts, 20, tree=tree)
        assert spec == plain, tree


def test_gemma3_head_size_256_on_the_kernel(attention_kernel_on, tiny_model_dir):
    """Gemma's head size (256) on the kernel: a tiny Gemma 3 checkpoint of head size 256 (sliding
    layers of a window of 8 beside full ones, its own query scale) loaded on the avx2 Linears runs
    its layers in the fused op (kernels/decoder_layers, short prefills too), or in Python with the
    kernel's two ops (prefills and decode steps); either way its greedy output is transformers',
    and on the op speculative greedy equals plain, eager and compiled."""
    from transformers import AutoModelForCausalLM

    from eagle_infer.loader import load_model
    from eagle_infer.speculative import SpecDecoder

    path = tiny_model_dir("gemma3_hd256")
    target = load_model(path, "fp32", "cpu", cpu_linears="avx2")
    stack = target.fused_layers
    assert target.config.head_dim == 256 and avx2_attention.enabled()
    assert stack is not None
    prompts = prompts_for(target.config.vocab_size)  # 3-17 tokens, then 24 new: past the window
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    refs = []
    for ids in prompts:
        with torch.no_grad():
            x = torch.tensor([ids])
            ref = hf.generate(x, attention_mask=torch.ones_like(x), do_sample=False, max_new_tokens=24)
        refs.append(ref[0, len(ids):].tolist())
    head = random_head(target, "eagle3", draft_vocab=64)
    ops, calls = torch.ops.eagle, {}

    class Spy:
        def __getattr__(self, name):
            op = getattr(ops, name)
            if name not in calls:
                return op

            def counted(*args):
                calls[name] += 1
                return op(*args)
            return counted

    for fused in (None, stack):  # the op last: the compiled steps below call it
        target.fused_layers = fused
        calls.update(avx2_attention=0, causal_attention=0, decoder_layers=0)
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(torch.ops, "eagle", Spy())
            plain = generate(target, prompts, 24)
        # the short prompts' prefills and the decode steps: inside the op, or on the kernel's ops
        assert (calls["decoder_layers"] > 0) is (fused is not None), calls
        assert (calls["avx2_attention"] > 0 and calls["causal_attention"] > 0) is (fused is None), calls
        assert plain == refs
    for tree in (TreeConfig(), TreeConfig(2, 4, 6, ngram_branch=4), TreeConfig.chain(3)):  # on the op
        assert generate_speculative(target, head, prompts, 24, tree=tree)[0] == plain, tree
    assert generate(target, prompts, 24, compile=True) == plain
    tree = TreeConfig(3, 4, 4)
    dec = SpecDecoder(target, head, tree, max_batch=4, max_seq_len=128).compile()
    assert generate_speculative(target, head, prompts, 24, tree=tree, decoder=dec)[0] == plain


def test_loader_turns_it_on_with_the_avx2_linears(monkeypatch, default_model_dir):
    from eagle_infer.errors import UserError
    from eagle_infer.kernels import bf16_linear
    from eagle_infer.loader import load_model

    before = avx2_attention.enabled(), avx2_attention.bf16_scores()
    try:
        avx2_attention.enable(False)
        monkeypatch.setenv("EAGLE_CPU_ATTENTION", "sdpa")
        load_model(default_model_dir, "fp32", "cpu", cpu_linears="avx2")
        assert not avx2_attention.enabled()
        monkeypatch.setenv("EAGLE_CPU_ATTENTION", "flash")
        with pytest.raises(UserError, match="must be auto, loops, dot, amx or sdpa, got 'flash'"):
            load_model(default_model_dir, "fp32", "cpu", cpu_linears="avx2")
        monkeypatch.delenv("EAGLE_CPU_ATTENTION")
        load_model(default_model_dir, "fp32", "cpu", cpu_linears="torch")
        assert not avx2_attention.enabled()  # only with the avx2 Linears, where it was measured
        load_model(default_model_dir, "fp32", "cpu", cpu_linears="avx2")
        assert avx2_attention.enabled()
        if bf16_linear.supported():  # bf16 on our Linears: the CPU's default scores, else as asked
            default = avx2_attention.default_bf16_scores()
            # another mode first, so that what the loader sets is what the assert reads
            avx2_attention.set_bf16_scores(next(m for m in ("loops", "dot") if m != default))
            load_model(default_model_dir, "bf16", "cpu", cpu_linears="avx512_bf16")
            assert avx2_attention.enabled() and avx2_attention.bf16_scores() == default
            dot = bf16_linear.avx512_bf16_supported()
            amd = bf16_linear.cpu_vendor() == "AuthenticAMD"
            # the tiles where the CPU has them, vdpbf16ps on AMD's AVX512-BF16, else the loops
            amx = bf16_linear.amx_supported()
            assert default == ("amx" if amx else "dot" if amd and dot else "loops")
            for mode, have in (("amx", bf16_linear.amx_supported()), ("dot", dot), ("loops", True)):
                monkeypatch.setenv("EAGLE_CPU_ATTENTION", mode)
                load_model(default_model_dir, "bf16", "cpu", cpu_linears="avx512_bf16")
                assert avx2_attention.enabled()
                assert avx2_attention.bf16_scores() == (mode if have else "loops")
    finally:
        avx2_attention.enable(before[0])
        avx2_attention.set_bf16_scores(before[1])
