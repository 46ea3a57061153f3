"""SGLang's native generation API (`POST /generate`, as SGLang serves it: its own benchmarks and
EAGLE tests, and RL frameworks, call it) over the completions path: `text` or `input_ids` (one or
a batch) and `sampling_params` become a completion request; each answer is {text, output_ids,
meta_info} with SGLang's finish_reason and token counts, and `spec_verify_ct` (verify passes: the
acceptance length is completion_tokens / spec_verify_ct, as SGLang's scripts read it). Beside it
SGLang's /get_server_info (server_info), whose avg_spec_accept_length its benchmarks print."""

from __future__ import annotations

import json
import time
from collections.abc import AsyncGenerator
from typing import Any

from pydantic import ValidationError

from eagle_infer.api_schema import ApiError, CompletionRequest, _Body

SGLANG_DEFAULT_MAX_NEW_TOKENS = 128  # SGLang's SamplingParams default
# sampling_params keys and the completion fields they are (SGLang's names -> ours)
SAMPLING_KEYS = {"max_new_tokens": "max_tokens", "min_new_tokens": "min_tokens", "temperature": "temperature",
                 "top_p": "top_p", "top_k": "top_k", "min_p": "min_p", "stop": "stop",
                 "stop_token_ids": "stop_token_ids", "ignore_eos": "ignore_eos",
                 "skip_special_tokens": "skip_special_tokens", "no_stop_trim": "include_stop_str_in_output",
                 "n": "n", "frequency_penalty": "frequency_penalty", "presence_penalty": "presence_penalty",
                 "repetition_penalty": "repetition_penalty", "logit_bias": "logit_bias",
                 "sampling_seed": "seed"}
# sampling_params keys that change nothing here (SGLang's output formatting of special tokens)
NEUTRAL_KEYS = {"spaces_between_special_tokens"}
GRAMMAR_KEYS = {"json_schema": "json", "regex": "regex", "ebnf": "grammar"}  # -> structured_outputs


PRIVATE_FLAGS = {"api_key", "ssl_keyfile", "ssl_certfile"}  # left out of /get_server_info


def server_info(flags: dict[str, Any], context: int, metrics: Any) -> dict[str, Any]:
    """SGLang's /get_server_info: the server's flags (keys and certificates left out), its
    context length and version, and `internal_states` (one engine): last_gen_throughput and,
    once a speculative round ran, avg_spec_accept_length, what SGLang's benchmarks read."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        ours = version("eagle-spec")
    except PackageNotFoundError:  # run from a source tree that was not installed
        ours = "unknown"
    state: dict[str, Any] = {"last_gen_throughput": metrics.last_gen_throughput}
    accept = metrics.avg_spec_accept_length()
    if accept is not None:
        state["avg_spec_accept_length"] = accept
    shown = {k: v for k, v in flags.items() if k not in PRIVATE_FLAGS}
    return {**shown, "context_length": context, "internal_states": [state], "version": ours}


class GenerateRequest(_Body):
    text: str | list[str] | None = None
    input_ids: list[int] | list[list[int]] | None = None
    sampling_params: dict[str, Any] | list[dict[str, Any]] | None = None
    stream: bool = False
    return_logprob: bool = False
    top_logprobs_num: int = 0
    return_text_in_logprobs: bool = False
    logprob_start_len: int = -1  # with return_logprob, the prompt's log-probs from this position (-1: none)
    rid: str | list[str] | None = None
    model: str | None = None

    def prompts(self, encode: Any, vocab: int) -> tuple[list[list[int]], bool]:
        """The prompts' token ids, and whether the request is a batch."""
        if (self.text is None) == (self.input_ids is None):
            raise ApiError(400, "give either text or input_ids", param="text", code="invalid_value")
        given = self.text if self.text is not None else self.input_ids
        if isinstance(given, list) and not given:
            raise ApiError(400, "an empty batch: give one prompt or more", param="text", code="invalid_value")
        if self.text is not None:
            batch = isinstance(self.text, list)
            return [list(encode(t)) for t in (self.text if batch else [self.text])], batch
        ids = self.input_ids or []
        batch = isinstance(ids[0], list)
        prompts = [list(p) for p in ids] if batch else [list(ids)]  # type: ignore[arg-type]
        if any(not 0 <= t < vocab for p in prompts for t in p):
            raise ApiError(400, f"input_ids must be in [0, {vocab})", param="input_ids", code="invalid_value")
        return prompts, batch

    def completion_requests(self, prompts: list[list[int]]) -> list[CompletionRequest]:
        """The completion requests this request stands for (its prompts as token ids): one for the
        batch, or where `sampling_params` is a list (SGLang's: one set a prompt) that differ, one a
        prompt (the server answers them as one batch, so `n` must agree)."""
        params = self.sampling_params
        if not isinstance(params, list):
            return [self.completion_request(prompts, params or {})]
        if len(params) != len(prompts):
            raise ApiError(400, f"sampling_params: a list of {len(params)} for {len(prompts)} prompt(s): "
                           "give one set a prompt, or one dict for all", param="sampling_params",
                           code="invalid_value")
        if all(p == params[0] for p in params):
            return [self.completion_request(prompts, params[0])]
        if any(p.get("n", 1) != params[0].get("n", 1) for p in params):
            raise ApiError(400, "sampling_params: n must be the same for every prompt of a batch here",
                           param="sampling_params", code="unsupported_parameter")
        return [self.completion_request([prompt], p) for prompt, p in zip(prompts, params)]

    def completion_request(self, prompts: list[list[int]], params: dict[str, Any]) -> CompletionRequest:
        """The completion request of these prompts (token ids) under these sampling params."""
        unknown = sorted(set(params) - set(SAMPLING_KEYS) - set(GRAMMAR_KEYS) - NEUTRAL_KEYS)
        if unknown:
            raise ApiError(400, f"sampling_params: {', '.join(unknown)} not supported here",
                           param="sampling_params", code="unsupported_parameter")
        body: dict[str, Any] = {"prompt": prompts, "max_tokens": SGLANG_DEFAULT_MAX_NEW_TOKENS,
                                "stream": self.stream}
        body |= {ours: params[key] for key, ours in SAMPLING_KEYS.items() if params.get(key) is not None}
        if body.get("top_k") == -1:
            body["top_k"] = 0  # SGLang's "off"
        grammars = {GRAMMAR_KEYS[k]: v for k, v in params.items() if k in GRAMMAR_KEYS and v is not None}
        if "json" in grammars and isinstance(grammars["json"], str):  # SGLang takes the schema as text
            try:
                grammars["json"] = json.loads(grammars["json"])
            except ValueError:
                raise ApiError(400, "sampling_params.json_schema: not JSON", param="sampling_params",
                               code="invalid_value") from None
        if grammars:
            body["structured_outputs"] = grammars
        if self.return_logprob:
            body["logprobs"] = self.top_logprobs_num
            if self.logprob_start_len >= 0:
                if self.stream:
                    raise ApiError(400, "logprob_start_len (the prompt's log-probs) is not supported "
                                   "with stream", param="logprob_start_len", code="unsupported_parameter")
                body["prompt_logprobs"] = self.top_logprobs_num
        try:
            return CompletionRequest.model_validate(body)
        except ValidationError as e:
            first = e.errors()[0]
            where = ".".join(str(p) for p in first["loc"] if not isinstance(p, int))
            raise ApiError(400, f"sampling_params (as completion {where}): {first['msg']}",
                           param="sampling_params", code="invalid_value") from None


class GenerateShape:
    """One /generate request's answers, from its jobs (server.Job: their tokens, counts and
    timing), whole or streamed."""

    def __init__(self, req: GenerateRequest, jobs: list[Any], batch: bool, n: int, tokenizer: Any):
        self.req, self.jobs, self.n, self.tokenizer = req, jobs, n, tokenizer
        self.single = not batch and len(jobs) == 1

    @staticmethod
    def error_body(err: ApiError) -> dict[str, Any]:
        return {"error": {"message": err.message}}  # SGLang's

    def rid(self, i: int) -> str:
        given = self.req.rid
        if isinstance(given, list):  # one a prompt (its n answers share it), as SGLang's
            return given[i // self.n] if i // self.n < len(given) else self.jobs[i].id
        return given if given is not None and self.single else self.jobs[i].id

    def meta_info(self, i: int, finish: str | None, stop_reason: Any, final: bool) -> dict[str, Any]:
        job = self.jobs[i]
        usage, seq = job.usage(), job.seq
        cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
        meta: dict[str, Any] = {"id": self.rid(i), "finish_reason": None,
                                "prompt_tokens": usage["prompt_tokens"],
                                "completion_tokens": usage["completion_tokens"], "cached_tokens": cached}
        if final:
            if finish == "length":
                meta["finish_reason"] = {"type": "length", "length": usage["completion_tokens"]}
            else:  # a stop string, a stop token's id, or the EOS it ended on
                matched = stop_reason if stop_reason is not None else (seq.output[-1] if seq.output else None)
                meta["finish_reason"] = {"type": "stop", "matched": matched}
            if "speculative" in usage:  # verify passes (SGLang counts every round's verify)
                meta["spec_verify_ct"] = usage["speculative"]["rounds"]
                meta["spec_accept_length"] = usage["speculative"]["acceptance_length"]
            meta["e2e_latency"] = round(time.perf_counter() - job.arrival, 6)
        if self.req.return_logprob:
            rows = seq.token_logprobs[:len(seq.output)]
            meta["output_token_logprobs"] = [[lp, t, self.text_of(t)]
                                             for (lp, _, _), t in zip(rows, seq.output)]
            meta["output_top_logprobs"] = [[[v, t, self.text_of(t)] for t, v in zip(ids, lps)]
                                           for _, ids, lps in rows]
            if job.prompt_logprobs is not None:
                meta |= self.input_logprobs(seq)
        return meta

    def input_logprobs(self, seq: Any) -> dict[str, list[Any]]:
        """SGLang's input_token_logprobs / input_top_logprobs: per prompt token from
        logprob_start_len, [logprob, id, text] (the first token's logprob None) and its
        alternatives (None for the first)."""
        k, start = self.req.top_logprobs_num, self.req.logprob_start_len
        scored = [None, *seq.prompt_token_logprobs]
        tokens = [[None if s is None else s[0], t, self.text_of(t)] for t, s in zip(seq.prompt, scored)]
        tops = [None if s is None else [[v, a, self.text_of(a)] for a, v in zip(s[1][:k], s[2][:k])]
                for s in scored]
        return {"input_token_logprobs": tokens[start:], "input_top_logprobs": tops[start:]}

    def text_of(self, token: int) -> str | None:
        return self.tokenizer.decode([token]) if self.req.return_text_in_logprobs else None

    def whole(self, answer: dict[str, Any]) -> dict[str, Any] | list[dict[str, Any]]:
        """The answers of a completion answer (server.full_response's)."""
        outs = [{"text": c["text"], "output_ids": list(self.jobs[c["index"]].seq.output),
                 "meta_info": self.meta_info(c["index"], c["finish_reason"], c.get("stop_reason"), True)}
                for c in answer["choices"]]
        return outs[0] if self.single else outs

    async def events(self, chunks: AsyncGenerator[str]) -> AsyncGenerator[dict[str, str]]:
        """SGLang's stream: per piece of an answer its text and output_ids so far and meta_info
        (the last with its finish_reason), `index` naming the answer in a batch; then [DONE]."""
        texts: dict[int, str] = {}
        try:
            async for raw in chunks:
                if raw == "[DONE]":
                    break
                chunk = json.loads(raw)
                if "error" in chunk:
                    yield {"data": json.dumps({"error": {"message": chunk["error"].get("message")}})}
                    break
                for c in chunk["choices"]:
                    i, final = c["index"], c.get("finish_reason") is not None
                    texts[i] = texts.get(i, "") + (c.get("text") or "")
                    # every piece the ids of its text so far, as SGLang's (without --stream-output)
                    job = self.jobs[i]
                    ids = job.seq.output if final else job.seq.output[:job.tokens_within(len(texts[i]))]
                    meta = self.meta_info(i, c.get("finish_reason"), c.get("stop_reason"), final)
                    out: dict[str, Any] = {"text": texts[i], "output_ids": list(ids), "meta_info": meta}
                    if not self.single:
                        out["index"] = i
                    yield {"data": json.dumps(out)}
        finally:
            await chunks.aclose()
        yield {"data": "[DONE]"}
