"""``python -m eagle_train stage=publish publish.repo_id=ORG/NAME``: a Hub-ready folder from a
trained head, uploaded when there is a token.

    python -m eagle_train stage=publish publish.repo_id=me/SmolLM2-135M-Instruct-eagle3
    python -m eagle_train stage=publish publish.repo_id=me/x \\
        publish.head=heads/SmolLM2-135M-Instruct-eagle3 publish.bench_json=results/bench_chain_eagle3.json
    HF_TOKEN=hf_... python -m eagle_train stage=publish publish.repo_id=me/x publish.private=true

The folder (``publish.out``, default ``<workdir>/publish/<NAME>``) holds the head in the official
layout (or ``publish.format=speculators``), its eval.json / train_summary.json / bench JSON, the
acceptance and loss plots, an FR-Spec token map for an EAGLE-2 head, and a model card (README.md)
whose numbers are copied from those JSON files. With a token (``HF_TOKEN``, or ``publish.token``;
prefer the variable: Hydra records overrides) it creates the repo and uploads the folder in one
commit through ``huggingface_hub``; without one it prints what it would upload.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path
from typing import Any

import yaml
from omegaconf import DictConfig

from eagle_infer.errors import UserError

CARD_MARK = "<!-- written by python -m eagle_train stage=publish -->"
PLOTS = ("acceptance.png", "train_loss.png")


# ---------------------------------------------------------------------------------------------
# Inputs


def _read_json(path: Path | None) -> dict[str, Any] | None:
    if path is None or not path.is_file():
        return None
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise UserError(f"{path} is not valid JSON: {e}") from None


def _first(*paths: Path | None) -> Path | None:
    return next((p for p in paths if p is not None and p.is_file()), None)


def bench_summary(b: dict[str, Any]) -> dict[str, Any]:
    """The numbers a card quotes from either bench JSON: `python -m eagle_infer.bench --json`'s or
    the pipeline's end-of-run bench.json."""
    if "speedup_vs_plain" in b:  # eagle_infer.bench
        s, m, t = b.get("settings") or {}, b.get("machine") or {}, b.get("tree") or {}
        tree = [t.get("num_steps"), t.get("eagle_topk"), t.get("num_draft_tokens")]
        out = {"speedup": b["speedup_vs_plain"], "spec_tokens_per_s": b.get("tokens_per_s"),
               "plain_tokens_per_s": b.get("plain_tokens_per_s"), "tau": b.get("acceptance_length"),
               "tree": tree, "dtype": s.get("dtype") or m.get("dtype"), "device": m.get("device"),
               "cpu": m.get("cpu"), "threads": m.get("torch_threads"), "prompts": s.get("num_prompts"),
               "max_new_tokens": s.get("max_new_tokens"), "greedy_identical": b.get("greedy_identical")}
        out["command"] = b.get("command") or (
            f"python -m eagle_infer.bench --num-prompts {out['prompts']} "
            f"--max-new-tokens {out['max_new_tokens']} --dtype {out['dtype']} --draft HEAD "
            f"--num-steps {tree[0]} --eagle-topk {tree[1]} --num-draft-tokens {tree[2]}"
            + (" --stop-at-eos" if s.get("ignore_eos") is False else ""))
        return out
    if "speedup" in b:  # the pipeline's bench.json
        n = b.get("prompts")  # "MT-bench first turns 1..N"
        if isinstance(n, str) and re.search(r"\.\.(\d+)$", n):
            n = int(re.search(r"\.\.(\d+)$", n).group(1))
        return {"speedup": b["speedup"], "spec_tokens_per_s": b.get("spec_tokens_per_s"),
                "plain_tokens_per_s": b.get("plain_tokens_per_s"), "tau": b.get("acceptance_length"),
                "tree": list(b.get("tree") or []), "dtype": b.get("dtype"), "device": b.get("device"),
                "cpu": b.get("cpu"), "threads": b.get("threads"), "prompts": n,
                "max_new_tokens": b.get("max_new_tokens"), "greedy_identical": b.get("greedy_identical"),
                "command": b.get("command") or "python -m eagle_train (end-of-pipeline bench, stage.bench)"}
    raise UserError("publish.bench_json: neither an eagle_infer.bench JSON (speedup_vs_plain) nor a pipeline "
                    "bench.json (speedup)")


# ---------------------------------------------------------------------------------------------
# Model card


def _f(x: Any, nd: int = 4) -> str:
    return "n/a" if x is None else f"{round(float(x), nd)}"


def _settings(path: Path | None) -> dict[str, Any]:
    if path is None or not path.is_file():
        return {}
    return yaml.safe_load(path.read_text()) or {}


def model_card(*, repo_id: str, base_model: str, kind: str, head_cfg: dict[str, Any], fmt: str,
               license_: str, library_name: str, ev: dict[str, Any] | None, bench: dict[str, Any] | None,
               summary: dict[str, Any] | None, train_cfg: dict[str, Any], files: list[str],
               token_map: str | None, head_src: str, target_path: str = "TARGET_FOLDER") -> str:
    """README.md: YAML metadata, then what the head is, what it measured, how it was trained and
    how to serve it. Every number is copied from eval.json, the bench JSON or train_summary.json."""
    name = repo_id.split("/")[-1]
    eagle3 = kind == "eagle3"
    tags = ["eagle3" if eagle3 else "eagle", "speculative-decoding", "draft-model"]
    if not eagle3:
        tags.insert(1, "eagle2")
    meta = {"base_model": base_model, "library_name": library_name, "license": license_, "tags": tags}
    lines = ["---", yaml.safe_dump(meta, sort_keys=False).strip(), "---", CARD_MARK, "",
             f"# {name}", ""]
    what = ("EAGLE-3 draft head (one decoder layer over three target hidden states, its own "
            f"{head_cfg.get('draft_vocab_size')}-token draft vocabulary mapped by `d2t`)" if eagle3 else
            "EAGLE-2 draft head (one decoder layer over the target's last hidden state; it drafts "
            "through the target's own lm_head)")
    lines += [f"{what} for speculative decoding of [{base_model}](https://huggingface.co/{base_model}). "
              f"Greedy outputs are the target's own, token for token; the head only makes decoding faster "
              f"when its drafts are accepted.", ""]
    lay = ("the official layout SGLang and EAGLE publish (config.json + model.safetensors)"
           if fmt == "official" else "vLLM's speculators layout (`speculators_model_type: eagle3`)")
    lines += [f"Weights in {lay}. Trained with eagle-spec (`python -m eagle_train`); source head "
              f"`{head_src}`.", ""]

    lines += ["## Measured acceptance", ""]
    if ev:
        tau = ev.get("acceptance_length")
        lines += [f"Offline chain acceptance length **τ = {_f(tau)}** (accepted drafts per step + the "
                  f"target's bonus token, chain of {ev.get('unroll')} drafts unrolled on the head's own "
                  f"outputs) on {ev.get('num_samples')} held-out conversations "
                  f"({ev.get('num_tokens')} tokens, {ev.get('num_start_positions')} start positions) "
                  f"of {ev.get('model', base_model)}.", ""]
        acc, top1 = ev.get("accept_rate_per_position") or [], ev.get("top1_per_position") or []
        n = max(len(acc), len(top1))
        lines += ["| draft position | " + " | ".join(str(i + 1) for i in range(n)) + " |",
                  "|---" * (n + 1) + "|",
                  "| acceptance (previous ones accepted) | " + " | ".join(_f(x) for x in acc) + " |",
                  "| top-1 match | " + " | ".join(_f(x) for x in top1) + " |", ""]
        fp = ev.get("fingerprint") or {}
        capture = fp.get("capture", ev.get("capture"))
        command = ev.get("command") or (
            f"python -m eagle_train stage=eval eval.head=HEAD capture_dir={capture} "
            f"eval.num_samples={fp.get('num_samples', ev.get('num_samples'))} eval.unroll={ev.get('unroll')}")
        lines += [f"Measured by `{command}` (held-out split of the capture `{ev.get('capture')}`); "
                  f"the numbers are `eval.json` in this repository.", ""]
    else:
        lines += ["Not measured (no eval.json): run `python -m eagle_train stage=eval eval.head=HEAD`.", ""]
    if "acceptance.png" in files:
        lines += ["![acceptance per draft position](acceptance.png)", ""]

    if bench:
        tree = bench.get("tree") or []
        lines += ["## Speed", "",
                  f"**{bench['speedup']}x** plain decoding: {bench.get('spec_tokens_per_s')} vs "
                  f"{bench.get('plain_tokens_per_s')} tokens/s, runtime τ {bench.get('tau')}, tree "
                  f"{'/'.join(map(str, tree))} (steps / top-k / draft tokens), {bench.get('dtype')} on "
                  f"{bench.get('device')} ({bench.get('cpu')}, torch threads: {bench.get('threads')}), "
                  f"{bench.get('prompts')} MT-bench prompts x {bench.get('max_new_tokens')} new tokens, "
                  "greedy" + (", output identical to plain decoding" if bench.get("greedy_identical") else "")
                  + ".",
                  "", f"Measured by `{bench['command']}` (eagle-spec's runtime; `bench.json` here).", ""]

    lines += ["## Training", ""]
    if summary:
        data, cap = train_cfg.get("data") or {}, train_cfg.get("capture") or {}
        tr = train_cfg.get("train") or {}
        src = data.get("source") or data.get("name")
        lines += [f"- data: {summary.get('samples')} conversations of `{src}` with answers regenerated by "
                  f"the target itself (on-policy, temperature {cap.get('temperature')}, up to "
                  f"{cap.get('max_new_tokens_per_turn')} new tokens a turn)" if cap.get("regenerate", True)
                  else f"- data: {summary.get('samples')} conversations of `{src}` (the dataset's answers)",
                  f"- tokens: {summary.get('tokens_total')} trained on ({summary.get('step')} steps, "
                  f"{summary.get('epochs_done')} epochs)",
                  f"- optimiser: AdamW lr {tr.get('lr')}, batch {tr.get('batch_size')}, "
                  f"warm start from `{tr.get('init_from')}`" if tr.get("init_from") else
                  f"- optimiser: AdamW lr {tr.get('lr')}, batch {tr.get('batch_size')}, from scratch",
                  f"- parameters: {summary.get('num_params')} (the target's embedding is shared, not stored)",
                  f"- final loss {_f(summary.get('final_loss'))}"]
        if train_cfg.get("train", {}).get("extra_captures"):
            lines.append(f"- extra captures: {train_cfg['train']['extra_captures']}")
        lines += ["", "Numbers from `train_summary.json`.", ""]
    else:
        lines += ["No train_summary.json was found beside the head.", ""]
    if "train_loss.png" in files:
        lines += ["![training loss](train_loss.png)", ""]

    lines += ["## Serving", "", "SGLang:", "", "```bash"]
    if fmt == "official":
        algo = "EAGLE3" if eagle3 else "EAGLE"
        tm = f" \\\n  --speculative-token-map {token_map}" if token_map else ""
        lines += [f"python -m sglang.launch_server --model-path {base_model} \\",
                  f"  --speculative-algorithm {algo} --speculative-draft-model-path {repo_id} \\",
                  "  --speculative-num-steps 3 \\",
                  f"  --speculative-eagle-topk 4 --speculative-num-draft-tokens 4{tm}"]
    else:
        lines += ["# SGLang reads the official layout: python -m eagle_train stage=export export.head=THIS "
                  "export.format=official"]
    lines += ["```", "", "vLLM:", "", "```bash"]
    if fmt == "speculators":
        lines += [f"vllm serve {repo_id}   # the verifier named in config.json"]
    else:
        method = "eagle3" if eagle3 else "eagle"
        lines += [f"vllm serve {base_model} --speculative-config "
                  f"'{{\"method\": \"{method}\", \"model\": \"{repo_id}\", \"num_speculative_tokens\": 3}}'"]
    lines += ["```", "", "eagle-spec's own OpenAI-compatible server:", "", "```bash",
              f"hf download {repo_id} --local-dir {name}",
              f"python -m eagle_infer.server --model-path {target_path} --speculative-algorithm "
              f"{'EAGLE3' if eagle3 else 'EAGLE'} \\",
              f"  --speculative-draft-model-path {name}"
              + (f" --speculative-token-map {name}/{token_map}" if token_map else ""),
              "```", ""]
    lines += ["## Files", ""] + [f"- `{f}`" for f in files + ["README.md"]] + [""]
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------
# Stage


def _prepare_out(out: Path) -> None:
    """An empty folder; refuse to wipe one this stage did not write."""
    if out.exists() and any(out.iterdir()):
        card = out / "README.md"
        if not (card.is_file() and CARD_MARK in card.read_text()):
            raise UserError(f"publish.out={out} exists and was not written by stage=publish: "
                            f"pick an empty folder")
        shutil.rmtree(out)
    out.mkdir(parents=True, exist_ok=True)


def build_folder(cfg: DictConfig) -> tuple[Path, dict[str, Any]]:
    """Write the Hub-ready folder; returns it and what went into the card."""
    from eagle_infer.default_model import DEFAULT_MODEL_ALIAS
    from eagle_infer.head_formats import export_head
    from eagle_train.export import source_head, target_arch, target_hub_id
    from eagle_train.pipeline import absolute, log, tokenmap_folder

    p = cfg.publish
    repo_id = str(p.repo_id or "")
    if repo_id.count("/") != 1 or not all(repo_id.split("/")):
        raise UserError(f"publish.repo_id={repo_id or 'null'}: give the Hub repository as ORG/NAME")
    head = source_head(cfg, "publish")
    own = head == Path(cfg.head_dir)  # the pipeline's own head: its eval/bench live in the workdir
    out = Path(absolute(p.out)) if p.get("out") else Path(cfg.workdir) / "publish" / repo_id.split("/")[1]
    fmt = str(p.format)
    base_model = str(p.base_model) if p.get("base_model") else target_hub_id(cfg)
    _prepare_out(out)
    arch = target_arch(cfg) if fmt == "speculators" else None
    export_head(head, out, fmt, verifier=base_model, verifier_arch=arch)
    head_cfg = json.loads((out / "config.json").read_text())
    kind = "eagle3" if fmt == "speculators" or "draft_vocab_size" in head_cfg else "eagle2"

    eval_path = Path(absolute(p.eval_json)) if p.get("eval_json") else _first(
        head / "eval.json", Path(cfg.eval_dir) / "eval.json" if own else None)
    ev = _read_json(eval_path)
    if p.get("eval_json") and ev is None:
        raise UserError(f"publish.eval_json={eval_path}: no such file")
    bench_path = Path(absolute(p.bench_json)) if p.get("bench_json") else (
        _first(Path(cfg.workdir) / "bench.json") if own else None)
    bench_raw = _read_json(bench_path)
    if p.get("bench_json") and bench_raw is None:
        raise UserError(f"publish.bench_json={bench_path}: no such file")
    bench = bench_summary(bench_raw) if bench_raw else None
    measured = (bench_raw or {}).get("draft") or (bench_raw or {}).get("head")
    if measured and Path(str(measured)).name != head.name:
        log(f"publish: warning: {bench_path} measured the head {measured}, not {head}")
    summary_path = _first(head / "train_summary.json")
    summary = _read_json(summary_path)
    train_cfg = _settings(_first(head / "train_config.yaml", head / "config.yaml"))

    copied = []
    sources = ((eval_path, "eval.json"), (bench_path, "bench.json"), (summary_path, "train_summary.json"))
    for src, name in sources:
        if src is not None and src.is_file():
            shutil.copyfile(src, out / name)
            copied.append(name)
    for plot in PLOTS:
        src = _first(head / plot, (Path(cfg.eval_dir) / plot) if own else None)
        if src is not None:
            shutil.copyfile(src, out / plot)
            copied.append(plot)
    token_map = None
    if kind == "eagle2":  # FR-Spec map for SGLang's --speculative-token-map (EAGLE-3 has d2t)
        tm = Path(absolute(p.token_map)) if p.get("token_map") else tokenmap_folder(cfg) / "frspec_8192.pt"
        if tm.is_file():
            shutil.copyfile(tm, out / tm.name)
            token_map = tm.name
            copied.append(tm.name)
        elif p.get("token_map"):
            raise UserError(f"publish.token_map={tm}: no such file")
    files = ["config.json", "model.safetensors", *copied]
    # The embedded default target needs no folder: eagle_infer resolves "default".
    target_path = "default" if str(cfg.model.path) == DEFAULT_MODEL_ALIAS else "TARGET_FOLDER"
    library = str(p.library_name) if p.get("library_name") else ("vllm" if fmt == "speculators" else "sglang")
    card = model_card(repo_id=repo_id, base_model=base_model, kind=kind, head_cfg=head_cfg, fmt=fmt,
                      license_=str(p.license), library_name=library, ev=ev, bench=bench, summary=summary,
                      train_cfg=train_cfg, files=files, token_map=token_map, head_src=str(head),
                      target_path=target_path)
    (out / "README.md").write_text(card)
    return out, {"repo_id": repo_id, "eval": ev, "bench": bench, "files": sorted(files + ["README.md"])}


def upload(folder: Path, repo_id: str, token: str, private: bool, message: str) -> str:
    """Create the repo (if missing) and upload the folder in one commit; returns the commit URL.
    HF_ENDPOINT, read here rather than at import, points it at another Hub."""
    from huggingface_hub import HfApi

    api = HfApi(endpoint=os.environ.get("HF_ENDPOINT") or None, token=token)
    api.create_repo(repo_id, private=private, exist_ok=True, repo_type="model")
    info = api.upload_folder(repo_id=repo_id, folder_path=str(folder), repo_type="model",
                             commit_message=message)
    return str(getattr(info, "commit_url", info))


def run(cfg: DictConfig) -> dict[str, Any]:
    from eagle_train.pipeline import log

    out, made = build_folder(cfg)
    p = cfg.publish
    ev = made["eval"] or {}
    log(f"publish: {out}: {len(made['files'])} files, held-out tau {_f(ev.get('acceptance_length'))}"
        + (f", bench {made['bench']['speedup']}x" if made["bench"] else ""))
    token = str(p.token) if p.get("token") else os.environ.get("HF_TOKEN")
    if not token:
        total = sum((out / f).stat().st_size for f in made["files"])
        log(f"publish: no token (HF_TOKEN or publish.token): would create {made['repo_id']} "
            f"({'private' if p.private else 'public'}) and upload {len(made['files'])} files, "
            f"{total / 1e6:.1f} MB: " + ", ".join(made["files"]))
        return made | {"out": str(out), "uploaded": False}
    message = str(p.commit_message) if p.get("commit_message") else f"Upload {made['repo_id'].split('/')[1]}"
    url = upload(out, made["repo_id"], token, bool(p.private), message)
    log(f"publish: uploaded {len(made['files'])} files to {made['repo_id']}: {url}")
    return made | {"out": str(out), "uploaded": True, "commit_url": url}

