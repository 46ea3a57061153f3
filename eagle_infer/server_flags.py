"""The server's command line: SGLang's flag names, vLLM's where SGLang has none (and vLLM's and
SGLang's names for the same settings, so a command line brought from either serves here), and
what the flags resolve to: the draft tree, compiled steps, sampling defaults, the tool-call
parser, the chat template. server.build_engine builds from them."""

from __future__ import annotations

import argparse
import json
import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

from eagle_infer.api_schema import MAX_LOGPROBS
from eagle_infer.default_model import default_head_path
from eagle_infer.errors import UserError
from eagle_infer.generate import CUDA_GRAPHS
from eagle_infer.loader import DTYPES, dtype_name
from eagle_infer.reasoning import PARSERS as REASONING_PARSERS
from eagle_infer.tool_calls import PARSERS
from eagle_infer.tree import TreeConfig

log = logging.getLogger("eagle_infer.server")  # the server's log: these are its flags
DEFAULT_HEAD = default_head_path("eagle3")


def json_of(kind: type, name: str) -> Callable[[str], Any]:
    """An argument type: JSON text holding a `kind` (a list, an object), else a clear error."""
    def parse(text: str) -> Any:
        try:
            value = json.loads(text)
        except ValueError as e:
            raise argparse.ArgumentTypeError(f"not JSON ({e}): {text!r}") from None
        if not isinstance(value, kind):
            raise argparse.ArgumentTypeError(f"not a JSON {name}: {text!r}")
        return value

    return parse


json_object = json_of(dict, "object")  # vLLM's --speculative-config, --override-generation-config
json_list = json_of(list, "list")  # vLLM's --allowed-origins


def dtype_flag(text: str) -> str:
    """--dtype: auto, or ours (fp32, bf16, fp16) and vLLM's and SGLang's names for them
    (loader.DTYPES: float32, bfloat16, half, ...), as our short name."""
    name = text.lower()
    if name == "auto":
        return name
    if name not in DTYPES:
        raise argparse.ArgumentTypeError(f"{text!r} is not a dtype: auto, fp32 (float32, float), bf16 "
                                         f"(bfloat16), fp16 (float16, half)")
    return dtype_name(DTYPES[name])


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m eagle_infer.server", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model-path", "--model", default="default",
                    help="HF folder; 'default' = embedded SmolLM2")
    ap.add_argument("--speculative-algorithm", type=str.upper, choices=["EAGLE", "EAGLE3", "NGRAM", "NONE"],
                    default=None, help="EAGLE (EAGLE-2 head), EAGLE3, NGRAM (prompt lookup, no head: "
                    "a chain of --speculative-num-draft-tokens - 1 tokens that followed the latest "
                    "earlier occurrence of the request's last tokens), or NONE (plain decoding); "
                    "default: EAGLE3 with the reference head when it is present, else NONE")
    ap.add_argument("--speculative-draft-model-path", default=None,
                    help=f"draft head folder (default: {DEFAULT_HEAD})")
    tree_help = (f"default: 5/4/16 (steps/topk/draft tokens) on a GPU; {TreeConfig.cpu_defaults_text()} "
                 "(+gK: an n-gram branch of K)")
    ap.add_argument("--speculative-num-steps", type=int, default=None, help=tree_help)
    ap.add_argument("--speculative-eagle-topk", type=int, default=None, help=tree_help)
    ap.add_argument("--speculative-num-draft-tokens", type=int, default=None, help=tree_help)
    ap.add_argument("--speculative-ngram-branch", type=int, default=None, metavar="K",
                    help="prompt lookup in the draft tree: up to K tokens that followed the latest "
                         "earlier occurrence of the request's last tokens compete with the head's for "
                         "the tree's places (0 = off); default: 4 on a CPU, 0 on a GPU (unmeasured there)")
    ap.add_argument("--speculative-ngram-min-match-window-size", type=int, default=None, metavar="N",
                    help="NGRAM: the fewest latest tokens a lookup matches (vLLM's prompt_lookup_min; "
                         "default 1); a round where no request's history matches that many is a plain step")
    ap.add_argument("--speculative-ngram-max-match-window-size", type=int, default=None, metavar="N",
                    help="NGRAM: the most latest tokens a lookup matches, the longest match winning "
                         "(vLLM's prompt_lookup_max; default 4)")
    ap.add_argument("--speculative-ngram-capacity", type=int, default=None, metavar="TOKENS",
                    help="NGRAM: tokens of served requests kept to look up in beside each request's own "
                         "history (SGLang's name, there in cache entries; ~600 bytes a token); 0 = own "
                         "history alone, vLLM's way: a seeded sampled request's tokens its own; default 100k")
    ap.add_argument("--speculative-batch-tree", default=None, metavar="MIN_BATCH:TREE",
                    help="a tree that shrinks as the batch grows: from MIN_BATCH running requests on, "
                         "rounds draft and verify TREE (STEPS/TOPK/DRAFT_TOKENS[+gK], e.g. 3:1/4/3+g4) "
                         "instead of the main tree (on a CPU a batch's trees make the verify "
                         "compute-bound: docs/measurements.md), or none. Default in bf16 on CPUs with AMX: "
                         "3:1/4/3+g4, 2:1/4/3+g4 with int8 weights; on AMD CPUs with AVX512-BF16: "
                         "3:1/4/2+g4 (bf16 weights); with rounds without drafts above 4 requests; "
                         "else none")
    ap.add_argument("--speculative-config", "-sc", type=json_object, default=None, metavar="JSON",
                    help='vLLM\'s flag: {"method": "eagle3" or "eagle", "model": HEAD_FOLDER, '
                         '"num_speculative_tokens": K, "disable_by_batch_size": N}, the same as '
                         "--speculative-algorithm, --speculative-draft-model-path, a chain of K drafts "
                         "(--speculative-num-steps K --speculative-eagle-topk 1 "
                         "--speculative-num-draft-tokens K+1) and --speculative-disable-by-batch-size; "
                         "leave num_speculative_tokens out for the default tree")
    ap.add_argument("--spec-method", default=None, metavar="METHOD",
                    help="vLLM's shorthand for --speculative-config's method (eagle3 or eagle)")
    ap.add_argument("--spec-model", default=None, metavar="HEAD_FOLDER",
                    help="vLLM's shorthand for --speculative-config's model")
    ap.add_argument("--spec-tokens", type=int, default=None, metavar="K",
                    help="vLLM's shorthand for --speculative-config's num_speculative_tokens (a chain)")
    ap.add_argument("--speculative-token-map", default=None, help="FR-Spec token map (EAGLE-2 heads)")
    ap.add_argument("--speculative-disable-by-batch-size", type=int, default=None, metavar="N",
                    help="while more than N requests are running, rounds draft nothing: a plain "
                         "decode step whose tokens the head catches up on later in one pass, so "
                         "speculation resumes when the batch shrinks (vLLM's name). Default: 2 on a CPU, "
                         "1 with int8 weights (where a batch's trees make the verify compute-bound: "
                         "docs/measurements.md), 4 with a batch tree, never on a GPU")
    ap.add_argument("--dtype", default="auto", type=dtype_flag, metavar="{auto,fp32,bf16,fp16}",
                    help="auto = bf16 where the hardware runs it fast (CUDA, AVX512-BF16 / AMX CPUs), "
                    "else fp32; greedy output is token-identical to plain decoding in fp32 (vLLM's and "
                    "SGLang's names too: float32 / float, bfloat16, float16 / half)")
    ap.add_argument("--quantization", default="none", choices=["none", "int8"],
                    help="int8: the target's (and head's) Linears weight-only int8 (CPU): decoding "
                         "follows the quantized target, whose activations round to bf16 "
                         "(docs/measurements.md)")
    ap.add_argument("--device", default=None, help="default: cuda when available, else cpu")
    ap.add_argument("--context-length", "--max-model-len", type=int, default=2048)
    # Compiled steps, with SGLang's flag names: CUDA graphs by default on CUDA, torch.compile
    # by default on a CPU (compile_settings), every compiled bucket warmed up before serving.
    ap.add_argument("--cuda-graph-max-bs", type=int, default=None, dest="cuda_graph_max_bs",
                    help="CUDA: largest batch bucket (1, 2, 4, 8, 16, ...) replayed as a CUDA graph "
                    "(default: the bucket of --max-running-requests); larger batches run eagerly")
    ap.add_argument("--disable-cuda-graph", action="store_false", dest="use_cuda_graph",
                    help="CUDA: run draft and verify eagerly (default: CUDA graphs per batch bucket)")
    ap.add_argument("--enable-torch-compile", action="store_true",
                    help="torch.compile the decode steps (Inductor; fp32 on AVX2 / AVX-512 CPUs and int8 "
                    "targets: frozen weights and its GEMM template, ~1.5-2 minutes a graph at a first "
                    "start on 2 cores, ~35 s from torch's compile cache later), one graph per batch "
                    "bucket, compiled before the server starts serving. Default on a CPU, where it "
                    "measured 1.25-1.43x the eager steps' tokens/s before the template (which took "
                    "another third off a plain step: docs/measurements.md)")
    ap.add_argument("--disable-torch-compile", action="store_false", dest="enable_torch_compile",
                    help="CPU: run the decode steps eagerly (no compile at start-up)")
    ap.set_defaults(enable_torch_compile=None)
    ap.add_argument("--enforce-eager", action="store_true",
                    help="vLLM's flag: no compiled steps (--disable-torch-compile and --disable-cuda-graph)")
    ap.add_argument("--torch-compile-max-bs", type=int, default=None,
                    help="with torch.compile: largest batch bucket (1, 2, 4, 8, 16, ...) compiled; "
                    "larger batches run eagerly (default: 1 on a CPU, where each bucket adds its "
                    "compile to the start-up and batches decode more tokens/s without speculation; "
                    "8 there with a batch tree, which a compiled batch needs to pay: docs/runtime.md; "
                    "else the bucket of --max-running-requests)")
    ap.add_argument("--max-running-requests", "--max-num-seqs", type=int, default=8)
    ap.add_argument("--chunked-prefill-size", type=int, default=None, metavar="N",
                    help="while requests run, a longer prompt is prefilled N tokens between their rounds "
                         "before it joins, so they do not wait for its whole prefill (with the prefix "
                         "cache; 0 or -1: in one piece; default 256 on a CPU, SGLang's 8192 on a GPU)")
    ap.add_argument("--disable-radix-cache", "--no-enable-prefix-caching", action="store_false",
                    dest="prefix_caching",
                    help="prefill every prompt whole: by default a prompt that starts with tokens a "
                         "cache row holds (an earlier request's prompt and answer: a chat's next turn, a "
                         "shared system prompt) takes those slots over and prefills the rest")
    ap.add_argument("--enable-prefix-caching", action="store_true", dest="prefix_caching",
                    help="vLLM's flag: prefix caching, on by default")
    ap.add_argument("--stream-interval", type=int, default=1, metavar="N",
                    help="a streamed request's text every N tokens (the first token's at once): fewer, "
                         "larger chunks (SGLang's and vLLM's flag; a speculative round's tokens share a "
                         "chunk anyway)")
    ap.add_argument("--chat-template", default=None, metavar="FILE_OR_TEXT",
                    help="a Jinja chat template (a file, or the template itself) in place of the "
                         "tokenizer's, e.g. one that shows tools to a model whose own template does not")
    ap.add_argument("--trust-request-chat-template", action="store_true",
                    help="a request's chat_template is used (vLLM's flag); without it such a request is "
                         "refused, as vLLM refuses it")
    ap.add_argument("--default-chat-template-kwargs", type=json_object, default=None, metavar="JSON",
                    help="the chat template's variables for requests that leave them out, merged under "
                         "a request's chat_template_kwargs (vLLM's flag), e.g. '{\"enable_thinking\": "
                         "false}'")
    ap.add_argument("--exclude-tools-when-tool-choice-none", action="store_true",
                    help="a request with tool_choice none does not show its tools to the template "
                         "(vLLM's flag)")
    ap.add_argument("--enable-auto-tool-choice", action="store_true",
                    help='tool_choice "auto" (the default with tools): the model decides whether to call '
                         "tools, --tool-call-parser finds the calls in its answer (vLLM's flags). A named "
                         'function and "required" work without: their answers are decoded under the '
                         "tools' JSON schemas")
    ap.add_argument("--tool-call-parser", default=None, choices=sorted(PARSERS),
                    help="the format the model writes its tool calls in: hermes "
                         "(<tool_call>{...}</tool_call>, Hermes / Qwen), llama3_json (Llama 3.x's JSON), "
                         "pythonic / llama4_pythonic (Llama 3.2 / 4's [f(x=1)]), phi4_mini_json "
                         "(Phi-4-mini's functools[...]), mistral ([TOOL_CALLS] in any tokenizer version's "
                         "format; call ids of 9 characters, as Mistral's templates take them); SGLang's "
                         "qwen25 / qwen (hermes) and llama3 (llama3_json) too")
    ap.add_argument("--reasoning-parser", default=None, choices=sorted(REASONING_PARSERS),
                    help="a thinking model's chat answers split into message.reasoning (the text before "
                         "</think>) and content (vLLM's flag and field): deepseek_r1, qwen3 (whose "
                         "chat_template_kwargs enable_thinking false makes the whole answer content); "
                         "SGLang's deepseek-r1 too")
    ap.add_argument("--generation-config", default="auto", metavar="auto|vllm|FOLDER",
                    help="default sampling of requests that leave it out (vLLM's flag): auto = the model's "
                         "generation_config.json (temperature, top_p, top_k, min_p, repetition / presence / "
                         "frequency penalties; max_new_tokens as max_tokens), as vLLM and SGLang serve; "
                         "vllm = OpenAI's neutral defaults; or the generation_config.json of FOLDER")
    ap.add_argument("--override-generation-config", type=json_object, default=None, metavar="JSON",
                    help='vLLM\'s flag: sampling defaults over --generation-config\'s, e.g. '
                         '\'{"temperature": 0.5, "max_new_tokens": 256}\'')
    ap.add_argument("--tensor-parallel-size", "-tp", "--tp-size", type=int, default=1,
                    help="vLLM's flag: 1 (one process serves here; our heads serve in vLLM and SGLang "
                         "for tensor parallelism)")
    ap.add_argument("--trust-remote-code", action="store_true",
                    help="vLLM's flag, accepted: no model code is downloaded or run here (the "
                         "architectures are built in)")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=30000)
    ap.add_argument("--api-key", default=None)
    ap.add_argument("--served-model-name", nargs="+", default=None, metavar="NAME",
                    help="the model's name in responses and /v1/models (the first; requests may name "
                         "any of them, or the model's path)")
    ap.add_argument("--log-level", default="info")
    # vLLM's and SGLang's names for what a command line brought over from them sets
    ap.add_argument("--seed", "--random-seed", type=int, default=None,
                    help="seeds the generator that requests without a seed sample from, at the start "
                         "of serving (vLLM's --seed, SGLang's --random-seed)")
    ap.add_argument("--enable-log-requests", "--log-requests", action="store_true", dest="log_requests",
                    help="log each request's prompt lengths and sampling settings (vLLM's and SGLang's "
                         "flags); off by default")
    ap.add_argument("--disable-log-requests", action="store_false", dest="log_requests",
                    help="vLLM's older flag: requests are not logged (the default)")
    ap.add_argument("--max-logprobs", type=int, default=MAX_LOGPROBS, metavar="N",
                    help=f"the most alternatives a request's logprobs / top_logprobs / prompt_logprobs "
                         f"may ask for per token (vLLM's flag and default, {MAX_LOGPROBS}; -1: the "
                         f"vocabulary)")
    ap.add_argument("--chat-template-content-format", default="auto", choices=["auto", "string", "openai"],
                    help="a message's content as the chat template gets it (vLLM's flag): string (the "
                         "text), openai (a list of {type: text, text} parts, for templates that loop over "
                         "parts) or auto (the default: openai where the template loops over a message's "
                         "content, as vLLM detects it)")
    ap.add_argument("--return-tokens-as-token-ids", action="store_true",
                    help="logprobs name tokens as 'token_id:{id}' for requests that leave "
                         "return_tokens_as_token_ids out (vLLM's flag and field)")
    ap.add_argument("--response-role", default="assistant",
                    help="a chat answer's role after a generation prompt (vLLM's flag); with "
                         "add_generation_prompt false, the last message's")
    ap.add_argument("--enable-metrics", action="store_true",
                    help="SGLang's flag, accepted: /metrics is always served here")
    ap.add_argument("--disable-log-stats", action="store_true",
                    help="vLLM's flag, accepted: no statistics are logged periodically here (/metrics "
                         "serves them)")
    ap.add_argument("--disable-uvicorn-access-log", action="store_true",
                    help="no uvicorn line per HTTP request (vLLM's flag)")
    ap.add_argument("--enable-request-id-headers", action="store_true",
                    help="answers carry an X-Request-Id header: the request's own, else a new id "
                         "(vLLM's flag)")
    ap.add_argument("--enable-force-include-usage", action="store_true",
                    help="streams end with a usage chunk whether or not stream_options asks (vLLM's flag)")
    ap.add_argument("--enable-prompt-tokens-details", action="store_true",
                    help="vLLM's flag, accepted: usage has prompt_tokens_details.cached_tokens whenever "
                         "the prefix cache gave a prompt some")
    ap.add_argument("--disable-fastapi-docs", action="store_true",
                    help="vLLM's flag, accepted: no docs pages are served here")
    ap.add_argument("-O", "--optimization-level", type=int, choices=[0, 1, 2, 3], default=None,
                    help="vLLM's: 0 runs the steps eagerly (--enforce-eager: the quickest start), 1-3 "
                         "compiled as by default")
    ap.add_argument("--uvicorn-log-level", default=None,
                    help="uvicorn's log level (vLLM's flag; default: --log-level)")
    ap.add_argument("--gpu-memory-utilization", "--mem-fraction-static", type=float, default=None,
                    metavar="FRACTION",
                    help="vLLM's and SGLang's flags, accepted: the KV cache here holds "
                         "--max-running-requests x --context-length tokens, whatever the memory")
    ap.add_argument("--kv-cache-dtype", default="auto", choices=["auto"],
                    help="the KV cache is in the model's dtype (vLLM's and SGLang's auto)")
    ap.add_argument("--block-size", "--page-size", type=int, default=None, metavar="N",
                    help="vLLM's (and SGLang's --page-size): a paged KV cache's page; accepted, not used "
                         "(each sequence's cache here is one slab of --context-length tokens)")
    ap.add_argument("--swap-space", type=float, default=None, metavar="GiB",
                    help="vLLM's CPU swap space for preempted sequences; accepted, not used (nothing is "
                         "preempted here: a batch holds --max-running-requests sequences)")
    ap.add_argument("--max-num-batched-tokens", type=int, default=None, metavar="N",
                    help="vLLM's flag: with chunked prefill, a long prompt's chunk (--chunked-prefill-size)")
    ap.add_argument("--enable-chunked-prefill", action=argparse.BooleanOptionalAction, default=None,
                    help="vLLM's flag: --no-enable-chunked-prefill prefills every prompt in one piece "
                         "(--chunked-prefill-size -1); chunked by default")
    ap.add_argument("--tokenizer", "--tokenizer-path", default=None, metavar="FOLDER",
                    help="the tokenizer's folder (default: the model's)")
    ap.add_argument("--tokenizer-mode", default="auto", choices=["auto", "hf"],
                    help="the folder's Hugging Face tokenizer (vLLM's auto and hf)")
    ap.add_argument("--allowed-origins", type=json_list, default=["*"], metavar="JSON",
                    help='CORS: the origins browsers may call from (vLLM\'s flag; default ["*"], as vLLM '
                         "and SGLang)")
    ap.add_argument("--root-path", default=None, help="the path a proxy serves the API under (uvicorn's)")
    ap.add_argument("--ssl-keyfile", default=None)
    ap.add_argument("--ssl-certfile", default=None)
    return ap


def resolve_disable_by_batch_size(args: argparse.Namespace, device_type: str,
                                  batch_tree: tuple[int, TreeConfig] | None = None) -> int | None:
    """--speculative-disable-by-batch-size, else the device's default
    (speculative.disable_by_batch_size_for, which a batch tree raises)."""
    from eagle_infer.speculative import disable_by_batch_size_for

    return disable_by_batch_size_for(args.speculative_disable_by_batch_size, device_type, args.quantization,
                                     batch_tree)


def resolve_batch_tree(args: argparse.Namespace, device_type: str,
                       dtype: str = "fp32") -> tuple[int, TreeConfig] | None:
    """--speculative-batch-tree, else the device's default (TreeConfig.batch_tree_for)."""
    return TreeConfig.batch_tree_for(args.speculative_batch_tree, device_type, args.quantization, dtype)


def resolve_tree(args: argparse.Namespace, device_type: str, dtype: str = "fp32") -> TreeConfig:
    """The tree flags given, the device's default (TreeConfig.default_for: by --quantization and
    the dtype that runs too) for the others."""
    return TreeConfig.from_flags(args.speculative_num_steps, args.speculative_eagle_topk,
                                 args.speculative_num_draft_tokens, device_type, args.quantization, dtype,
                                 args.speculative_ngram_branch)


def compile_settings(args: argparse.Namespace, device_type: str,
                     batch_tree: tuple[int, TreeConfig] | None = None
                     ) -> tuple[str | None, int | None] | None:
    """(torch.compile mode, largest batch bucket compiled; None = the bucket of
    --max-running-requests), or None for eager steps: CUDA graphs ("reduce-overhead") on CUDA
    unless --disable-cuda-graph; Inductor on a CPU unless --disable-torch-compile (up to batch 1,
    up to 8 with a batch tree, unless --torch-compile-max-bs says otherwise), elsewhere where
    --enable-torch-compile asks. With the batch tree a compiled batch of 4 paid where an eager
    one did not: AMX Xeon, 16 MT-bench requests x 128 tokens at concurrency 4 (docs/measurements.md), 245.2
    tokens/s against 211.2 plain, eager 210.8 against 223.2; and batches of 5-8, whose rounds
    draft nothing (disable_by_batch_size_for), compiled: Zen 4, 32 requests at concurrency 8,
    four pairs alternating, 357.7-409.3 against 317.5-370.5 tokens/s (medians 392.8 / 368.2), the
    bucket's graphs ~43 s at a cold start, 0-4 s warm."""
    if device_type == "cuda" and args.use_cuda_graph:
        return CUDA_GRAPHS, args.cuda_graph_max_bs
    on_cpu = device_type == "cpu"
    if args.enable_torch_compile or (args.enable_torch_compile is None and on_cpu):
        max_bs = args.torch_compile_max_bs
        if on_cpu and max_bs is None:
            max_bs = 8 if batch_tree is not None else 1
        return None, max_bs
    return None


SPECULATIVE_CONFIG_FLAGS = {"method": "speculative_algorithm", "model": "speculative_draft_model_path",
                            "disable_by_batch_size": "speculative_disable_by_batch_size",
                            "prompt_lookup_min": "speculative_ngram_min_match_window_size",
                            "prompt_lookup_max": "speculative_ngram_max_match_window_size"}


def apply_vllm_flags(args: argparse.Namespace) -> None:
    """vLLM's flags that stand for ours (--speculative-config, --enforce-eager,
    --max-num-batched-tokens and --[no-]enable-chunked-prefill for --chunked-prefill-size), the
    ones that ask for what one process cannot be (--tensor-parallel-size above 1), refused by
    name, and those with nothing to set here (--gpu-memory-utilization), said so."""
    apply_speculative_config(args)
    if args.optimization_level == 0:  # vLLM's -O0: no compilation
        args.enforce_eager = True
    if args.tensor_parallel_size != 1:
        raise UserError(f"--tensor-parallel-size {args.tensor_parallel_size}: one process serves here "
                        f"(serve our heads in vLLM or SGLang for tensor parallelism)")
    if args.enforce_eager:
        if args.enable_torch_compile:
            raise UserError("--enforce-eager and --enable-torch-compile both given: pass one of them")
        args.enable_torch_compile, args.use_cuda_graph = False, False
    if args.trust_remote_code:
        log.info("--trust-remote-code: nothing to trust, no model code is downloaded or run here")
    if args.gpu_memory_utilization is not None:
        if not 0.0 < args.gpu_memory_utilization <= 1.0:
            raise UserError(f"--gpu-memory-utilization must be in (0, 1], got {args.gpu_memory_utilization}")
        log.info("--gpu-memory-utilization: not used here, the KV cache holds --max-running-requests "
                 "x --context-length tokens")
    for flag, value in (("--block-size", args.block_size), ("--swap-space", args.swap_space)):
        if value is not None:
            if value <= 0:
                raise UserError(f"{flag} must be > 0, got {value}")
            log.info("%s: not used here, the KV cache is a slab of --context-length tokens a sequence", flag)
    if args.max_logprobs < -1:
        raise UserError(f"--max-logprobs must be >= 0 (or -1: the vocabulary), got {args.max_logprobs}")
    chunking = args.enable_chunked_prefill, args.max_num_batched_tokens
    if chunking != (None, None):
        if args.chunked_prefill_size is not None:
            raise UserError("--chunked-prefill-size and --max-num-batched-tokens / --[no-]enable-chunked-"
                            "prefill both given: pass one of them")
        if args.enable_chunked_prefill is False:
            args.chunked_prefill_size = 0
        elif args.max_num_batched_tokens is not None:
            if args.max_num_batched_tokens < 1:
                raise UserError(f"--max-num-batched-tokens must be >= 1, got {args.max_num_batched_tokens}")
            args.chunked_prefill_size = args.max_num_batched_tokens
        args.enable_chunked_prefill = args.max_num_batched_tokens = None  # applied


def apply_speculative_config(args: argparse.Namespace) -> None:
    """vLLM's --speculative-config, written into the flags it stands for (SPECULATIVE_CONFIG_FLAGS,
    num_speculative_tokens K as a chain: K steps, top-1, K + 1 nodes). Refuses a method other
    than EAGLE's, a key it does not know and a flag given both ways. vLLM's --spec-method,
    --spec-model and --spec-tokens are its method, model and num_speculative_tokens."""
    short = {key: value for key, value in (("method", args.spec_method), ("model", args.spec_model),
                                           ("num_speculative_tokens", args.spec_tokens)) if value is not None}
    if short:
        if args.speculative_config is not None:
            raise UserError("--speculative-config and --spec-method / --spec-model / --spec-tokens both "
                            "given: pass one of them")
        args.speculative_config = short
        args.spec_method = args.spec_model = args.spec_tokens = None  # applied
    conf = args.speculative_config
    if conf is None:
        return
    known = {*SPECULATIVE_CONFIG_FLAGS, "num_speculative_tokens", "draft_tensor_parallel_size"}
    unknown = sorted(set(conf) - known)
    if unknown:
        raise UserError(f"--speculative-config: {', '.join(unknown)} not supported here (it takes "
                        f"{', '.join(sorted(known))})")
    if conf.get("draft_tensor_parallel_size", 1) != 1:
        raise UserError("--speculative-config: draft_tensor_parallel_size must be 1 (one process)")
    values = dict(conf)
    if "method" in values:
        method = str(values["method"]).lower()
        if method not in ("eagle", "eagle3", "ngram"):
            raise UserError(f"--speculative-config: method {method!r} is not served here: eagle "
                            f"(EAGLE-2 heads), eagle3 or ngram (prompt lookup)")
        values["method"] = method.upper()
    k = values.pop("num_speculative_tokens", None)
    flags = {flag: values[key] for key, flag in SPECULATIVE_CONFIG_FLAGS.items() if key in values}
    if k is not None:
        if not isinstance(k, int) or isinstance(k, bool) or k < 1:
            raise UserError(f"--speculative-config: num_speculative_tokens must be a positive integer, "
                            f"got {k!r}")
        flags["speculative_num_draft_tokens"] = k + 1
        if values.get("method") != "NGRAM":
            flags |= {"speculative_num_steps": k, "speculative_eagle_topk": 1}
    for flag, value in flags.items():
        if getattr(args, flag) is not None:
            raise UserError(f"--speculative-config and --{flag.replace('_', '-')} both given: "
                            f"pass one of them")
        setattr(args, flag, value)
    args.speculative_config = None  # applied


SAMPLING_DEFAULT_FIELDS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "presence_penalty",
                           "frequency_penalty")


def sampling_defaults_of(source: str, model_folder: Path, override: dict[str, Any] | None = None
                         ) -> dict[str, Any]:
    """--generation-config: the sampling fields (SAMPLING_DEFAULT_FIELDS, and max_new_tokens as
    max_tokens) that a generation_config.json sets away from transformers' defaults, vLLM's
    reading of it; "vllm": none; auto: the model's, FOLDER: that folder's; then
    --override-generation-config's over them."""
    from transformers import GenerationConfig

    unknown = sorted(set(override or {}) - {*SAMPLING_DEFAULT_FIELDS, "max_new_tokens"})
    if unknown:
        raise UserError(f"--override-generation-config: {', '.join(unknown)} not a sampling field "
                        f"(it takes {', '.join([*SAMPLING_DEFAULT_FIELDS, 'max_new_tokens'])})")
    diff: dict[str, Any] = {}
    folder = model_folder if source == "auto" else Path(source).expanduser()
    if source not in ("auto", "vllm") and not (folder / "generation_config.json").is_file():
        raise UserError(f"--generation-config {source}: no generation_config.json in {folder}")
    if source != "vllm":
        try:
            diff = GenerationConfig.from_pretrained(folder).to_diff_dict()
        except OSError:  # the model has none
            pass
    bad = [k for k, v in (override or {}).items() if not isinstance(v, (int, float)) or isinstance(v, bool)]
    if bad:
        raise UserError(f"--override-generation-config: {', '.join(bad)} must be a number")
    diff |= override or {}
    out = {k: diff[k] for k in SAMPLING_DEFAULT_FIELDS if diff.get(k) is not None}
    if diff.get("max_new_tokens") is not None:
        out["max_tokens"] = int(diff["max_new_tokens"])
    if out:
        log.warning("requests that leave sampling fields out get %s (--generation-config %s%s; vllm for "
                    "OpenAI's neutral defaults)", out, source,
                    " with --override-generation-config" if override else "")
    return out


def tool_parser_of(args: argparse.Namespace) -> str | None:
    """--tool-call-parser; --enable-auto-tool-choice needs one (vLLM's rule)."""
    if args.enable_auto_tool_choice and not args.tool_call_parser:
        raise UserError(f"--enable-auto-tool-choice needs --tool-call-parser ({', '.join(sorted(PARSERS))})")
    return args.tool_call_parser


def chat_template_of(given: str | None) -> str | None:
    """--chat-template: a file's text, else the text given (a template has braces; a name without
    them is a missing file)."""
    if given is None:
        return None
    if Path(given).is_file():
        return Path(given).read_text()
    if "{" not in given:
        raise UserError(f"--chat-template {given}: no such file (nor a Jinja template)")
    return given


def content_format_of(template: str | None) -> str:
    """--chat-template-content-format auto, as vLLM resolves it: "openai" where the template loops
    over a message's content (a list of {type, text} parts: multimodal models' templates), else
    "string". A message is what a loop over `messages` (or a name set from it: `loop_messages =
    messages[1:]`) binds; its content `message['content']` or `message.content`, directly, filtered
    (`| selectattr(...)`), through a name set from it or a macro's parameter; a loop over a name
    `content` counts too (vLLM's rule). A template that does not parse: string."""
    from jinja2 import TemplateSyntaxError, nodes
    from transformers.utils.chat_template_utils import _compile_jinja_template

    if not template:
        return "string"
    try:  # transformers' environment: its extensions ({% generation %}, loop controls) parse
        tree = _compile_jinja_template(template).environment.parse(template)
    except TemplateSyntaxError:
        return "string"

    def inner(node: nodes.Node) -> nodes.Node:  # x[1:], x | filter, x is test: x
        while isinstance(node, (nodes.Filter, nodes.Test)) or (
                isinstance(node, nodes.Getitem) and isinstance(node.arg, nodes.Slice)):
            node = node.node
        return node

    def named(node: nodes.Node, names: set[str]) -> bool:
        node = inner(node)
        return isinstance(node, nodes.Name) and node.name in names

    def item_of(node: nodes.Node, names: set[str]) -> bool:  # messages[0]
        node = inner(node)
        return (isinstance(node, nodes.Getitem) and isinstance(node.arg, nodes.Const)
                and isinstance(node.arg.value, int) and named(node.node, names))

    def content_of(node: nodes.Node, names: set[str]) -> bool:
        node = inner(node)
        if isinstance(node, nodes.Getitem) and isinstance(node.arg, nodes.Const):
            return node.arg.value == "content" and named(node.node, names)
        return isinstance(node, nodes.Getattr) and node.attr == "content" and named(node.node, names)

    def bound(sources: set[str], binds: Callable[[nodes.Node, set[str]], bool],
              loops: bool) -> set[str]:
        """Names set (or, with loops, looped) from an expression `binds` recognises, to a fixpoint:
        a name set from such a name is one too."""
        names: set[str] = set()
        while True:
            found = set(names)
            for node in tree.find_all(nodes.Assign):
                target = node.target
                if isinstance(target, nodes.Name) and (binds(node.node, sources) or named(node.node, found)):
                    found.add(target.name)
            if loops:
                for node in tree.find_all(nodes.For):
                    if isinstance(node.target, nodes.Name) and binds(node.iter, sources):
                        found.add(node.target.name)
            if found == names:
                return names
            names = found

    lists = {"messages"} | bound({"messages"}, named, loops=False)
    messages = bound(lists, named, loops=True) | bound(lists, item_of, loops=False)
    contents = bound(messages, content_of, loops=False) | {"content"}  # vLLM: any loop over `content`
    in_macros: set[int] = set()
    for macro in tree.find_all(nodes.Macro):  # a macro's parameters that calls pass a content to
        params = [arg.name for arg in macro.args]
        given = set()
        for call in tree.find_all(nodes.Call):
            if isinstance(call.node, nodes.Name) and call.node.name == macro.name:
                given |= {name for name, arg in zip(params, call.args) if content_of(arg, messages)}
                given |= {kw.key for kw in call.kwargs if content_of(kw.value, messages)}
        for loop in macro.find_all(nodes.For):
            in_macros.add(id(loop))
            if named(loop.iter, given) or content_of(loop.iter, messages):
                return "openai"
    for loop in tree.find_all(nodes.For):
        if id(loop) not in in_macros and (content_of(loop.iter, messages) or named(loop.iter, contents)):
            return "openai"
    return "string"
