"""Offline batches in OpenAI's Batch API file format, as `vllm run-batch` runs them:

    python -m eagle_infer.run_batch -i requests.jsonl -o results.jsonl [any server flag]

Each input line is {"custom_id", "method": "POST", "url", "body"}; `url` is any route the server
answers by POST (/v1/chat/completions, /v1/completions, /v1/responses, /v1/messages, /generate,
...), and the body is that route's request (not streamed). The server's engine and app run in
this process (the same flags, the same speculative decoding), the requests go to the app without
a socket, many at once so continuous batching fills the batch, and each result is appended as a
line as soon as it is done:

    {"id": "batch_req_...", "custom_id", "response": {"status_code", "request_id", "body"}, "error"}

In the order they finish (as OpenAI's, which says to match results by custom_id). A failed
request's line has its status and error body, and `error` the body's error object (vLLM's
readers look there). A run that was killed resumes: the lines already written are kept (a last
one cut mid-write is dropped, and server errors, status 5xx, are run again) and only the
requests without a result run.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import time
import uuid
from pathlib import Path
from typing import Any

from eagle_infer.api_schema import ApiError
from eagle_infer.errors import UserError, cli_errors

log = logging.getLogger("eagle_infer.run_batch")


def read_requests(path: Path) -> list[dict[str, Any]]:
    """The input file's requests, checked: a UserError names the first bad line."""
    if str(path).startswith(("http://", "https://")):
        raise UserError(f"--input-file {path}: only local files here (no network)")
    if not path.is_file():
        raise UserError(f"--input-file {path}: no such file")
    requests, seen = [], set()
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            req = json.loads(line)
        except ValueError as e:
            raise UserError(f"{path}:{n}: not JSON ({e})") from None
        if not isinstance(req, dict):
            raise UserError(f"{path}:{n}: a request is an object with custom_id, method, url and body")
        missing = [k for k in ("custom_id", "url", "body") if k not in req]
        if missing:
            raise UserError(f"{path}:{n}: missing {', '.join(missing)}")
        if not isinstance(req["custom_id"], str) or not isinstance(req["url"], str):
            raise UserError(f"{path}:{n}: custom_id and url are strings")
        if req.get("method", "POST") != "POST":
            raise UserError(f"{path}:{n}: method {req['method']!r}: only POST")
        if not isinstance(req["body"], dict):
            raise UserError(f"{path}:{n}: body is the route's request object")
        if req["custom_id"] in seen:
            raise UserError(f"{path}:{n}: custom_id {req['custom_id']!r} is used twice "
                            "(each names one result)")
        seen.add(req["custom_id"])
        requests.append(req)
    return requests


def results_so_far(path: Path) -> set[str]:
    """The custom_ids an earlier run of this batch has results for. A last line cut mid-write (a
    killed run: no newline) and the results of server errors (status 5xx: the request may pass
    when run again) are removed from the file, to be written again; any other line that is not
    a result is refused."""
    if not path.exists():
        return set()
    lines = path.read_text().splitlines(keepends=True)
    done, kept = set(), []
    for i, line in enumerate(lines):
        try:
            result = json.loads(line)
            custom_id, status = result["custom_id"], (result.get("response") or {}).get("status_code", 500)
        except (ValueError, KeyError, TypeError, AttributeError):
            if i != len(lines) - 1 or line.endswith("\n"):  # a cut line has no end
                raise UserError(f"--output-file {path}: line {i + 1} is not a result; "
                                "not the output of this command?") from None
            continue
        if status < 500:
            done.add(custom_id)
            kept.append(line)
    if len(kept) < len(lines):
        log.info("%s: %d lines (a cut line, server errors) are run again", path, len(lines) - len(kept))
        path.write_text("".join(kept))
    return done


def result_line(req: dict[str, Any], status: int, body: Any) -> dict[str, Any]:
    """The output line of one request (OpenAI's batch output; `error` also set on failures, as vLLM)."""
    error = body.get("error") if status != 200 and isinstance(body, dict) else None
    if status != 200 and error is None:
        error = {"message": str(body)}
    return {"id": f"batch_req_{uuid.uuid4().hex}", "custom_id": req["custom_id"],
            "response": {"status_code": status, "request_id": f"batch-{uuid.uuid4().hex}", "body": body},
            "error": error}


async def run_requests(app: Any, requests: list[dict[str, Any]], out: Any, concurrency: int,
                       headers: dict[str, str], progress: Any = None) -> dict[str, int]:
    """Each request sent to the ASGI app (at most `concurrency` at once), its result line
    appended to `out` (flushed) when done; returns {"ok", "failed"} counts."""
    import httpx

    counts, gate = {"ok": 0, "failed": 0}, asyncio.Semaphore(concurrency)
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://batch", timeout=None) as http:
        async def one(req: dict[str, Any]) -> None:
            async with gate:
                if req["body"].get("stream"):
                    status, body = 400, ApiError(400, "stream is not supported in a batch", param="stream",
                                                 code="unsupported_parameter").body()
                else:
                    try:
                        answer = await http.post(req["url"], json=req["body"], headers=headers)
                        status = answer.status_code
                        try:
                            body = answer.json()
                        except ValueError:
                            body = answer.text
                    except Exception as e:  # a bug behind one request must not end the batch
                        log.exception("request %s failed", req["custom_id"])
                        failure = ApiError(500, f"{type(e).__name__}: {e}", code="internal_error")
                        status, body = 500, failure.body()
            counts["ok" if status == 200 else "failed"] += 1
            out.write(json.dumps(result_line(req, status, body)) + "\n")
            out.flush()
            if progress is not None:
                progress.update()

        await asyncio.gather(*(one(r) for r in requests))
    return counts


def build_parser() -> argparse.ArgumentParser:
    from eagle_infer.server import build_parser as server_parser

    p = server_parser()
    p.prog = "python -m eagle_infer.run_batch"
    p.description = __doc__.split("\n\n")[0]
    p.add_argument("-i", "--input-file", type=Path, required=True,
                   help="requests in OpenAI's batch format (JSONL: custom_id, method, url, body)")
    p.add_argument("-o", "--output-file", type=Path, required=True,
                   help="results, a line each as they finish (an existing file: the run resumes)")
    p.add_argument("--batch-concurrency", type=int, default=None,
                   help="requests in flight at once (default: 2x --max-running-requests)")
    return p


@cli_errors
def main(argv: list[str] | None = None) -> None:
    import gc

    from tqdm import tqdm

    from eagle_infer.server import configure_logging, start_serving

    args = build_parser().parse_args(argv)
    configure_logging(args)
    logging.getLogger("httpx").setLevel(logging.WARNING)  # not a line per request
    if args.batch_concurrency is not None and args.batch_concurrency < 1:
        raise UserError("--batch-concurrency must be >= 1")
    requests = read_requests(args.input_file)
    done = results_so_far(args.output_file)
    todo = [r for r in requests if r["custom_id"] not in done]
    if done:
        log.info("resuming: %d of %d requests have results in %s", len(requests) - len(todo), len(requests),
                 args.output_file)
    if not todo:
        print(f"all {len(requests)} requests have results in {args.output_file}")
        return
    engine, app = start_serving(args)
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    concurrency = args.batch_concurrency or 2 * args.max_running_requests
    args.output_file.parent.mkdir(parents=True, exist_ok=True)
    engine.start()
    t0 = time.perf_counter()
    try:
        with (open(args.output_file, "a") as out,
              tqdm(total=len(todo), unit="req", desc="Running batch") as bar):
            counts = asyncio.run(run_requests(app, todo, out, concurrency, headers, bar))
    finally:
        engine.stop()
        gc.unfreeze()  # (start_serving's freeze)
    seconds = time.perf_counter() - t0
    m = engine.metrics
    tokens = m.registry.get_sample_value("eagle:generation_tokens_total", {"model_name": m.model_name}) or 0
    accept = m.avg_spec_accept_length()
    print(f"{len(todo)} requests in {seconds:.1f} s ({counts['ok']} ok, {counts['failed']} failed), "
          f"{tokens:.0f} tokens generated, {tokens / seconds:.1f} tokens/s"
          + (f", acceptance length {accept:.2f}" if accept is not None else "")
          + f"; results in {args.output_file}")


if __name__ == "__main__":
    main()
