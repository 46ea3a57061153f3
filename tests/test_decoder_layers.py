"""kernels/decoder_layers: a target's layers as one C++ call. It computes what the Python layers
compute (fp32 to rounding, logits, hidden states and cache writes), a row's result does not depend
on the rows beside it, model.forward hands it decode and verify calls (eager and compiled) of
targets whose Linears all run our kernels, greedy speculative decoding on it is token-identical
to plain decoding on it, and bad input or a released stack gets a clear error."""

from __future__ import annotations

import copy
import gc

import pytest
import torch
from test_speculative import prompts_for, random_head

from eagle_infer.cpu_linears import AVX2_MAX_ROWS, use_avx2_linears, use_bf16_linears
from eagle_infer.errors import UserError
from eagle_infer.generate import generate
from eagle_infer.kernels import avx2_attention, avx2_linear, bf16_linear, decoder_layers
from eagle_infer.model import ModelConfig, Transformer, causal_mask
from eagle_infer.quantize import quantize_linears
from eagle_infer.speculative import generate_speculative
from eagle_infer.tree import TreeConfig

pytestmark = pytest.mark.skipif(not avx2_linear.supported(), reason="CPU without AVX2 / FMA")
needs_bf16 = pytest.mark.skipif(not bf16_linear.supported(), reason="CPU without AVX2 / FMA")


# The layer kinds the op computes: Llama's; Qwen2's (q/k/v biases); Qwen3's (head size 128, each
# head's queries and keys normed before RoPE); Phi-4-mini's (3/4 of each head turned, LongRoPE's
# scaled tables: the op reads them as given); Mistral-7B-v0.1's (every layer sliding: the window is
# in the mask the op reads; 4 slots, which the calls below outgrow)
ARCHS = {"llama": {}, "qwen2": {"attention_bias": True}, "qwen3": {"head_dim": 128, "qk_norm": True},
         "phi4_mini": {"rotary_dim": 48, "rope_scaling": {
             "rope_type": "longrope", "short_factor": [1.0 + 0.1 * i for i in range(24)],
             "long_factor": [2.0 + 0.5 * i for i in range(24)],
             "factor": 4.0, "original_max_position_embeddings": 512}},
         "mistral_window": {"sliding_window": 4, "sliding_layers": (0, 1, 2)},
         # Qwen3's use_sliding_window from max_window_layers on: windows in some layers, one RoPE
         # (the op reads those layers' own mask, as Gemma 3's)
         "qwen3_window": {"head_dim": 128, "qk_norm": True, "sliding_window": 4, "sliding_layers": (1, 2)},
         # Gemma 3's: norms scaling by 1 + weight in fp32, norms on the attention's and the MLP's
         # outputs, tanh GELU, head size 256, a score scale of its own (not 1/sqrt(D)), and two
         # sliding layers of 4 slots with a RoPE base of their own; Gemma's (1, 2B): the offset
         # norms and GELU alone
         "gemma3": {"head_dim": 256, "qk_norm": True, "norm_offset": 1.0, "sandwich_norms": True,
                    "hidden_act": "gelu_pytorch_tanh", "query_scale": 200 ** -0.5, "embed_scale": 128 ** 0.5,
                    "sliding_window": 4, "sliding_layers": (0, 2), "rope_theta": 1e6,
                    "local_rope_theta": 1e4},
         "gemma": {"norm_offset": 1.0, "hidden_act": "gelu_pytorch_tanh", "embed_scale": 128 ** 0.5}}


def fp32_target(layers: int = 3, attention_bias: bool = False, heads: int = 4,
                kv_heads: int = 2, qk_norm: bool = False, head_dim: int = 64, **config) -> Transformer:
    """A tiny fp32 target of head size 64 (or 128: the attention kernel's) on torch's Linears;
    config: more ModelConfig fields."""
    cfg = ModelConfig(model_type="llama", vocab_size=96, hidden_size=128, intermediate_size=192,
                      num_layers=layers, num_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim,
                      max_position_embeddings=512, eos_token_ids=[], attention_bias=attention_bias,
                      qk_norm=qk_norm, **config)
    torch.manual_seed(0)
    target = Transformer(cfg).eval().requires_grad_(False)
    with torch.no_grad():
        target.embed_tokens.weight.normal_(0, 1.0)
        target.lm_head.weight.normal_(0, 0.6)
        for layer in target.layers:  # norms off 1 and biases off 0, so one misapplied shows
            attn = layer.self_attn
            for norm in (layer.input_layernorm, layer.post_attention_layernorm,
                         getattr(layer, "pre_feedforward_layernorm", None),
                         getattr(layer, "post_feedforward_layernorm", None),
                         getattr(attn, "q_norm", None), getattr(attn, "k_norm", None)):
                if norm is not None:  # scaling by 0.5-1.5 (Gemma's by 1 + weight)
                    norm.weight.uniform_(0.5 - norm.offset, 1.5 - norm.offset)
            if attention_bias:
                attn.qkv_proj.bias.normal_(0, 0.5)
    return target


def on_our_kernels(target: Transformer, dtype: torch.dtype = torch.float32, linears: str = "ours",
                   head: torch.nn.Module | None = None) -> Transformer:
    """The target (and its head) in dtype on our kernels ("ours": avx2 in fp32, bf16_linear in bf16;
    "int8": int8 weights on bf16_linear's kernel, as the loader and load_head_for do), its layers
    attached."""
    target = target.to(dtype)
    if linears == "int8":
        for module in (target, head):
            if module is not None:
                quantize_linears(module.to(dtype), "int8", "avx512_bf16")
    elif dtype == torch.float32:
        use_avx2_linears(target)
    else:
        use_bf16_linears(target)
    decoder_layers.attach(target)
    return target


def tiny_target(dtype: torch.dtype = torch.float32, linears: str = "ours",
                arch: str = "llama") -> Transformer:
    return on_our_kernels(fp32_target(**ARCHS[arch]), dtype, linears)


def step_both_ways(target: Transformer, T: int, taps: list[int]):
    """Two prompts prefilled on the Python layers, then T more tokens each (a chain) through the
    fused layers and, from the same cache, through the Python layers: (logits, hidden, cache) each."""
    B, P = 2, 9
    target.setup_cache(B, 64)
    g = torch.Generator().manual_seed(5)
    prompt = torch.randint(0, 96, (B, P), generator=g)
    pos = torch.arange(P).expand(B, P)
    stack, target.fused_layers = target.fused_layers, None
    target(prompt, pos, pos, causal_mask(torch.zeros(B, dtype=torch.long), P, P))
    before = target.cache.kv.clone()
    tokens = torch.randint(0, 96, (B, 8), generator=g)[:, :T]  # the same first tokens whatever T
    new = (P + torch.arange(T)).expand(B, T)
    mask = causal_mask(torch.full((B,), P), T, 32)
    results = []
    for fused in (stack, None):
        target.fused_layers = fused
        target.cache.kv.copy_(before)
        logits, hidden = target(tokens, new, new, mask, hidden_layers=taps)
        results.append((logits, hidden, target.cache.kv.clone()))
    target.fused_layers = stack
    return results


@pytest.mark.parametrize("T", [1, 5])
@pytest.mark.parametrize("arch", ARCHS)
def test_fused_layers_compute_the_python_layers(attention_kernel_on, T, arch):
    target = tiny_target(arch=arch)
    assert decoder_layers.applies(target, 2, T)
    taps = [0, 2, 1, 3]  # 3 = the final normed state, taken in Python either way
    (logits, hidden, kv), (ref_logits, ref_hidden, ref_kv) = step_both_ways(target, T, taps)
    torch.testing.assert_close(logits, ref_logits, rtol=1e-5, atol=1e-4)
    assert len(hidden) == len(taps)
    for got, ref in zip(hidden, ref_hidden):
        torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(kv, ref_kv, rtol=1e-5, atol=1e-5)  # the new keys (rotated) and values
    assert not torch.equal(kv, torch.zeros_like(kv))


@pytest.mark.parametrize("dtype,linears", [
    (torch.float32, "ours"),
    pytest.param(torch.bfloat16, "ours", marks=needs_bf16),
    pytest.param(torch.bfloat16, "int8", marks=needs_bf16),
])
@pytest.mark.parametrize("arch", ARCHS)
def test_a_rows_result_does_not_depend_on_the_rows_beside_it(attention_kernel_on, dtype, linears, arch):
    target = tiny_target(dtype=dtype, linears=linears, arch=arch)
    one, *_ = step_both_ways(target, 1, [1])[0]
    five, *_ = step_both_ways(target, 5, [1])[0]
    assert torch.equal(one[:, 0], five[:, 0])  # each sequence's first new token, bit for bit


def alone_and_beside(target: Transformer, P: int, T: int, kv_len: int, cache_len: int, seed: int,
                     masked_slot: int | None = None):
    """Two prompts of P tokens prefilled, then T more tokens each from the same cache: both
    sequences in one call, then the first alone. ((logits, layer-1 input, its cache row) of the
    first sequence beside the second, the same alone); masked_slot: a prompt slot no row attends."""
    B = 2
    target.setup_cache(B, cache_len)
    g = torch.Generator().manual_seed(seed)
    prompt = torch.randint(0, 96, (B, P), generator=g)
    pos = torch.arange(P).expand(B, P)
    target(prompt, pos, pos, causal_mask(torch.zeros(B, dtype=torch.long), P, P))
    before = target.cache.kv.clone()
    tokens, new = torch.randint(0, 96, (B, T), generator=g), (P + torch.arange(T)).expand(B, T)
    mask = causal_mask(torch.full((B,), P), T, kv_len)
    if masked_slot is not None:
        mask[:, :, masked_slot] = False
    pair, hidden = target(tokens, new, new, mask, hidden_layers=[1])
    pair_kv = target.cache.kv[:, :, 0].clone()
    target.cache.kv.copy_(before)
    alone, alone_hidden = target(tokens[:1], new[:1], new[:1], mask[:1], hidden_layers=[1])
    return (pair[0], hidden[0][0], pair_kv), (alone[0], alone_hidden[0][0], target.cache.kv[:, :, 0])


# fp32 on the AVX2 kernel, bf16 on ours, int8 weights on it
DTYPE_LINEARS = [(torch.float32, "ours"), pytest.param(torch.bfloat16, "ours", marks=needs_bf16),
                 pytest.param(torch.bfloat16, "int8", marks=needs_bf16)]


@pytest.mark.parametrize("T", [1, 5])
@pytest.mark.parametrize("dtype,linears", DTYPE_LINEARS)
def test_a_sequences_result_does_not_depend_on_the_batch_beside_it(attention_kernel_on, dtype, linears, T):
    """Alone (batch 1: fewer kv heads than twice the threads) the op's attention splits each kv
    head's rows between the threads; beside another sequence, a thread takes whole kv heads."""
    target = tiny_target(dtype=dtype, linears=linears)
    (pair, hidden, _), (alone, alone_hidden, _) = alone_and_beside(target, 9, T, 40, 64, seed=6)
    assert torch.equal(alone, pair) and torch.equal(alone_hidden, hidden)


@pytest.mark.parametrize("T", [1, 3])
@pytest.mark.parametrize("dtype,linears", DTYPE_LINEARS)
def test_sequences_of_other_lengths_read_only_their_own_slots(attention_kernel_on, dtype, linears, T):
    """A batch's step runs at its longest sequence's kv length; a shorter one's slots past its end
    are masked and left unread (avx2_attention.cpp live_slots): NaN there must not reach it, and its
    logits and hidden states equal its own step's alone at its own length, bit for bit. Four
    sequences of 3 kv heads are 12 tasks the threads take as they come free; alone, one sequence's 3
    kv heads split in halves on 2 threads (bf16 scores on vdpbf16ps) or go whole."""
    target = on_our_kernels(fp32_target(heads=6, kv_heads=3), dtype, linears)
    lens = torch.tensor([60, 7, 33, 18])  # each sequence's prompt
    B, P = len(lens), int(lens.max())
    target.setup_cache(B, 96)
    g = torch.Generator().manual_seed(3)
    pos, prompt = torch.arange(P).expand(B, P), torch.randint(0, 96, (B, P), generator=g)
    target(prompt, pos, pos, causal_mask(torch.zeros(B, dtype=torch.long), P, P))
    for b, n in enumerate(lens.tolist()):  # past each prompt: NaN, which the new rows overwrite in part
        target.cache.kv[:, :, b, :, n:] = float("nan")
    before = target.cache.kv.clone()
    tokens, new = torch.randint(0, 96, (B, T), generator=g), lens[:, None] + torch.arange(T)
    mask = causal_mask(lens, T, P + T + 5)
    logits, hidden = target(tokens, new, new, mask, hidden_layers=[1])
    assert not logits.isnan().any()
    for b, n in enumerate(lens.tolist()):
        target.cache.kv.copy_(before)
        own = mask[b:b + 1, :, :n + T].clone()  # its own kv length: no masked tail
        at = new[b:b + 1]
        alone, alone_hidden = target(tokens[b:b + 1], at, at, own, hidden_layers=[1], row0=b)
        assert torch.equal(alone, logits[b:b + 1]) and torch.equal(alone_hidden[0], hidden[0][b:b + 1]), b


# P: a prompt within one block of 16 keys (phase 1's second half reads none), blocks that do not
# halve, a partial last block; T = 2: a verify's two rows (4 a kv head: not in chunks)
@needs_bf16
@pytest.mark.parametrize("P,T,head_dim", [(6, 1, 64), (40, 1, 64), (300, 2, 64), (40, 1, 128), (40, 1, 256)])
def test_a_split_attention_leaves_a_sequences_bits_alone(attention_kernel_on, P, T, head_dim):
    """On 2 threads the attention of one sequence's decode step over 3 kv heads runs in two phases,
    each in halves of every kv head (kernel_calls.h split_attention; vdpbf16ps scores: the keys'
    halves, then P V's halves of d); beside a second sequence the threads take whole kv heads: the
    sequence's logits, hidden states and cache must be the same bits either way, with a masked
    slot amid the prompt's."""
    if avx2_attention.set_bf16_scores("dot") != "dot":
        avx2_attention.set_bf16_scores(avx2_attention.default_bf16_scores())
        pytest.skip("CPU without AVX512-BF16")
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        target = on_our_kernels(fp32_target(heads=6, kv_heads=3, head_dim=head_dim), torch.bfloat16)
        kv_len = P + 4 if P < 12 else P + 20  # slots after the new rows: masked
        beside, alone = alone_and_beside(target, P, T, kv_len, P + 24, seed=P, masked_slot=P // 3)
        for got, want in zip(alone, beside):  # logits, hidden state, cache row
            assert torch.equal(got, want)
    finally:
        torch.set_num_threads(threads)
        avx2_attention.set_bf16_scores(avx2_attention.default_bf16_scores())


@needs_bf16
@pytest.mark.parametrize("linears", ["ours", "int8"])
@pytest.mark.parametrize("arch", ARCHS)
def test_bf16_and_int8_layers_round_where_the_python_layers_do(attention_kernel_on, linears, arch):
    target = tiny_target(dtype=torch.bfloat16, linears=linears, arch=arch)
    (logits, hidden, _), (ref_logits, ref_hidden, _) = step_both_ways(target, 5, [1, 2])
    # the same bf16 roundings, the sums of squares in another order: at most a bf16 step apart
    torch.testing.assert_close(logits.float(), ref_logits.float(), rtol=2e-2, atol=5e-2)
    for got, ref in zip(hidden, ref_hidden):
        torch.testing.assert_close(got.float(), ref.float(), rtol=2e-2, atol=5e-2)
    assert (logits.argmax(-1) == ref_logits.argmax(-1)).float().mean() >= 0.9


def test_compiled_steps_call_the_op(attention_kernel_on):
    targets = [tiny_target(), tiny_target()]
    graphs = []

    def keep_graph(gm, inputs):
        graphs.append(gm)
        return gm.forward

    tokens, pos = torch.tensor([[3]]), torch.tensor([[4]])
    mask = causal_mask(torch.tensor([4]), 1, 16)
    for target in targets:
        target.setup_cache(1, 64)
        torch._dynamo.reset()
        torch.compile(target, backend=keep_graph, fullgraph=True)(tokens, pos, pos, mask)
    # the stack's id is an input, not a constant: one graph for either target (torch's compile
    # cache serves a graph to any process, whatever id its target got)
    assert targets[0].fused_layers.id != targets[1].fused_layers.id
    assert graphs[0].code == graphs[1].code
    calls = [n.target for n in graphs[-1].graph.nodes if n.op == "call_function"]
    op, linear = torch.ops.eagle.decoder_layers, torch.ops.eagle.avx2_linear
    assert sum(t in (op, op.default) for t in calls) == 1
    assert sum(t in (linear, linear.default) for t in calls) == 1  # the lm_head's; the layers' are in the op
    # the weights are named by the stack's id, not passed: only a few tensors enter the graph
    assert len([n for n in graphs[-1].graph.nodes if n.op == "placeholder"]) < 12


@pytest.mark.parametrize("dtype,linears,arch", [
    (torch.float32, "ours", "llama"),
    (torch.float32, "ours", "qwen3"),
    (torch.float32, "ours", "mistral_window"),  # 20 tokens past prompts of 3-17: the window of 4 bites
    (torch.float32, "ours", "gemma3"),  # the sliding layers' own window and RoPE likewise
    (torch.float32, "ours", "qwen3_window"),
    pytest.param(torch.bfloat16, "ours", "gemma3", marks=needs_bf16),
    pytest.param(torch.bfloat16, "int8", "llama", marks=needs_bf16),
    pytest.param(torch.bfloat16, "int8", "qwen2", marks=needs_bf16),
])
def test_greedy_identical_on_the_fused_layers_eager_and_compiled(attention_kernel_on, dtype, linears, arch):
    target = fp32_target(**ARCHS[arch])
    head = random_head(target, "eagle3", draft_vocab=40).to(dtype)
    target = on_our_kernels(target, dtype, linears, head)
    assert target.fused_layers is not None
    prompts = prompts_for(target.config.vocab_size)
    plain = generate(target, prompts, 20)  # batch 4: every decode step has 4 rows of 1 query
    assert generate(target, prompts, 20, compile=True) == plain
    for tree in (TreeConfig(), TreeConfig(2, 4, 4), TreeConfig.chain(3)):
        spec, _ = generate_speculative(target, head, prompts, 20, tree=tree)
        assert spec == plain, tree


def test_attach_declines_what_the_op_does_not_compute(attention_kernel_on, monkeypatch):
    assert on_our_kernels(fp32_target(head_dim=32)).fused_layers is None  # no attention kernel for it
    gemma2 = fp32_target(**ARCHS["gemma"], sandwich_norms=True, attn_softcap=50.0, final_softcap=30.0)
    assert on_our_kernels(gemma2).fused_layers is None  # Gemma 2's soft-capped scores
    biased_o = fp32_target()
    biased_o.layers[1].self_attn.o_proj.bias = torch.nn.Parameter(torch.ones(128), requires_grad=False)
    assert on_our_kernels(biased_o).fused_layers is None  # a bias the op does not add
    torch_linears = tiny_target()
    assert torch_linears.fused_layers.max_rows == AVX2_MAX_ROWS  # its Linears' kernel limit
    assert decoder_layers.applies(torch_linears, 4, 8) and not decoder_layers.applies(torch_linears, 3, 11)
    plain = fp32_target()  # torch's Linears
    assert decoder_layers.attach(plain) is None and plain.fused_layers is None
    monkeypatch.setenv("EAGLE_FUSED_LAYERS", "0")
    assert tiny_target().fused_layers is None
    monkeypatch.setenv("EAGLE_FUSED_LAYERS", "yes")
    with pytest.raises(UserError, match="EAGLE_FUSED_LAYERS must be 0 or 1, got 'yes'"):
        tiny_target()
    monkeypatch.delenv("EAGLE_FUSED_LAYERS")
    avx2_attention.enable(False)
    assert tiny_target().fused_layers is None  # the op calls the attention kernel


def test_bad_input_and_released_stacks_get_clear_errors(attention_kernel_on):
    target = tiny_target()
    target.setup_cache(1, 64)
    x, cos = torch.randn(1, 128), torch.randn(1, 1, 1, 64)
    bias, index = torch.zeros(1, 1, 1, 16), torch.tensor([0, 64, 128, 192])
    op, stack = torch.ops.eagle.decoder_layers, target.fused_layers
    out = op(stack.handle, x, cos, cos, bias, cos, cos, bias, index, target.cache.kv, 0, 1, [1])
    assert out.shape == (2, 1, 128)
    with pytest.raises(RuntimeError, match="write_index"):
        op(stack.handle, x, cos, cos, bias, cos, cos, bias, index[:3], target.cache.kv, 0, 1, [])
    with pytest.raises(RuntimeError, match="write index .* outside the cache"):
        op(stack.handle, x, cos, cos, bias, cos, cos, bias, index * 1000, target.cache.kv, 0, 1, [])
    with pytest.raises(RuntimeError, match="kv"):
        op(stack.handle, x, cos, cos, bias, cos, cos, bias, index, target.cache.kv[:2], 0, 1, [])
    with pytest.raises(RuntimeError, match="x in .* dtype|x's dtype"):
        op(stack.handle, x, cos.double(), cos, bias, cos, cos, bias, index, target.cache.kv, 0, 1, [])
    with pytest.raises(RuntimeError, match=r"x \[B\*T, 128\] in the stack's dtype"):
        op(stack.handle, torch.randn(1, 64), cos, cos, bias, cos, cos, bias, index, target.cache.kv, 0, 1, [])
    tensors, kinds, dims, local, eps, query_factor, _ = decoder_layers.stack_arguments(
        tiny_target(arch="qwen3"))
    tensors[15 + 2] = torch.empty(0)  # layer 1 without its query norm
    with pytest.raises(RuntimeError, match="query and key norms of 128 values .* in every layer, or in none"):
        torch.ops.eagle.register_stack(tensors, kinds, dims, local, eps, query_factor)
    tensors, kinds, dims, local, eps, query_factor, _ = decoder_layers.stack_arguments(
        tiny_target(arch="gemma3"))
    tensors[15 + 6] = tensors[15 + 6].bfloat16()  # layer 1's norm after the MLP not in fp32 (1 + weight)
    with pytest.raises(RuntimeError, match="norms before and after the MLP of 128 values in Float"):
        torch.ops.eagle.register_stack(tensors, kinds, dims, local, eps, query_factor)
    with pytest.raises(RuntimeError, match="local layer 7 is not a layer of 3"):
        torch.ops.eagle.register_stack(tensors, kinds, dims, [7], eps, query_factor)
    stack_id = stack.id
    del target, stack
    gc.collect()
    with pytest.raises(RuntimeError, match=f"no registered stack {stack_id}"):
        op(torch.tensor(stack_id), x, cos, cos, bias, cos, cos, bias, index, torch.zeros(3, 2, 1, 2, 64, 64),
           0, 1, [])


def test_the_loader_attaches_the_layers_with_our_kernels(attention_kernel_on, default_model_dir):
    from eagle_infer.loader import load_model

    assert load_model(default_model_dir, "fp32", "cpu", cpu_linears="avx2").fused_layers is not None
    assert load_model(default_model_dir, "fp32", "cpu", cpu_linears="torch").fused_layers is None


def test_copies_and_conversions_of_a_model_do_not_run_the_old_weights(attention_kernel_on):
    target = tiny_target()
    assert copy.deepcopy(target).fused_layers is None  # its own weights: the Python layers
    assert target.fused_layers is not None
    target.double().float()  # new weight tensors
    assert target.fused_layers is None
    assert decoder_layers.attach(target) is not None
