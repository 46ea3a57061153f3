"""Stage dispatch for ``python -m eagle_train``, the pipeline runner and the tokenmap stage.

Stages: capture -> tokenmap -> train -> eval; ``stage=pipeline`` runs all four in order and
skips each one whose outputs are already complete, so running the same command again resumes.

A stage module may define ``is_complete(cfg) -> bool`` (capture does; train / eval may): the
pipeline skips the stage when it returns True, and otherwise calls its ``run(cfg)``, which is
expected to pick up where an interrupted run stopped.

Every stage saves the resolved config (``config.yaml``, all paths absolute) beside its outputs.
"""

from __future__ import annotations

import importlib
import json
import shutil
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from eagle_infer.errors import UserError
from eagle_train.shards import atomic_write_json, atomic_write_text

STAGES = ("capture", "tokenmap", "train", "eval")
STAGE_MODULES = {"capture": "eagle_train.capture", "train": "eagle_train.train",
                 "eval": "eagle_train.evaluate"}
TOOL_STAGES = {"export": "eagle_train.export", "publish": "eagle_train.publish"}
PATH_KEYS = ("workdir", "capture_dir", "tokenmap_dir", "head_dir", "eval_dir")
TOKENMAP_RECORD = "tokenmap.json"
DEFAULT_DRAFT_VOCAB = 8192
SHIPPED = "shipped"  # train.init_from value: the reference head shipped for this target (heads/)
BENCH_FILE = "bench.json"


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


# ---------------------------------------------------------------------------------------------
# Config


def absolute(path: str | Path) -> str:
    """A path relative to where the user ran the command (not Hydra's run directory)."""
    from hydra.utils import to_absolute_path

    return str(Path(to_absolute_path(str(Path(path).expanduser()))))


def prepare_config(cfg: DictConfig) -> DictConfig:
    """Resolve every interpolation and make the paths absolute; returns a new struct config."""
    from eagle_infer.default_model import DEFAULT_MODEL_ALIAS
    from eagle_train.data import BUILTIN_SOURCES

    out = OmegaConf.create(OmegaConf.to_container(cfg, resolve=True))
    for key in PATH_KEYS:
        if out.get(key) is not None:
            out[key] = absolute(out[key])
    mpath = OmegaConf.select(out, "model.path")
    if mpath is not None and str(mpath) != DEFAULT_MODEL_ALIAS and Path(absolute(mpath)).exists():
        out.model.path = absolute(mpath)
    src = OmegaConf.select(out, "data.source")
    if src is not None and str(src) not in BUILTIN_SOURCES:
        out.data.source = absolute(src)
    tsrc = OmegaConf.select(out, "tokenmap.source")
    if tsrc is not None and str(tsrc) != "capture":
        out.tokenmap.source = absolute(tsrc)
    init = OmegaConf.select(out, "train.init_from")
    if init is not None and str(init) == SHIPPED:
        shipped = shipped_head(out)
        out.train.init_from = None if shipped is None else str(shipped)
        log(f"train.init_from=shipped: warm start from the reference head {shipped}, adapted on this data "
            f"(from scratch: train.init_from=null train.lr=3e-4)" if shipped is not None else
            f"train.init_from=shipped: no reference head ships for {OmegaConf.select(out, 'model.name')}: "
            f"training from scratch")
    elif init:
        out.train.init_from = absolute(init)
    OmegaConf.set_struct(out, True)
    return out


def shipped_head(cfg: DictConfig) -> Path | None:
    """The shipped reference head of this draft kind when the target is the embedded default
    (the only target heads/ holds heads for), else None."""
    from eagle_infer.default_model import DEFAULT_MODEL_ALIAS, DEFAULT_MODEL_NAME, default_head_path

    mpath = str(OmegaConf.select(cfg, "model.path", default=DEFAULT_MODEL_ALIAS))
    if mpath not in (DEFAULT_MODEL_ALIAS, DEFAULT_MODEL_NAME):
        return None
    try:
        path = default_head_path(str(OmegaConf.select(cfg, "draft.name", default="eagle3")))
    except FileNotFoundError:
        return None
    return path if (path / "config.json").is_file() else None


def init_head_vocab(cfg: DictConfig) -> tuple[Any, Any, Path] | None:
    """(d2t, t2d, head) of the EAGLE-3 head that train.init_from warm-starts from, or None (no
    warm start, or an EAGLE-2 head). Its lm_head rows mean its own draft tokens, so a warm-started
    run must train with exactly that vocabulary, not a freshly mined one."""
    from safetensors import safe_open

    init = OmegaConf.select(cfg, "train.init_from")
    if not init or str(OmegaConf.select(cfg, "draft.name", default="eagle3")) != "eagle3":
        return None
    head = Path(str(init))
    weights = head / "model.safetensors"
    if not weights.is_file():
        raise UserError(f"train.init_from={head}: no model.safetensors there")
    with safe_open(str(weights), framework="pt") as st:
        if "d2t" not in st.keys() or "t2d" not in st.keys():
            return None  # full-vocabulary head
        d2t, t2d = st.get_tensor("d2t").long(), st.get_tensor("t2d").bool()
    if d2t.numel() != draft_vocab_size(cfg):
        raise UserError(f"train.init_from={head} drafts over {d2t.numel()} tokens but "
                        f"draft.draft_vocab_size={draft_vocab_size(cfg)}: set "
                        f"draft.draft_vocab_size={d2t.numel()}, or train from scratch (train.init_from=null)")
    return d2t, t2d, head


def resolve_device(name: Any) -> str | None:
    """cfg.device -> a device for load_model (None = cuda when available, else cpu)."""
    if name is None or str(name) == "auto":
        return None
    return str(name)


def tokenmap_folder(cfg: DictConfig) -> Path:
    """Where mine_token_maps writes this model's maps: <tokenmap_dir>/<model name>."""
    return Path(cfg.tokenmap_dir) / str(cfg.model.name).replace("/", "--")


def draft_vocab_size(cfg: DictConfig) -> int:
    return int(OmegaConf.select(cfg, "draft.draft_vocab_size", default=None) or DEFAULT_DRAFT_VOCAB)


def draft_vocab_file(cfg: DictConfig) -> Path:
    """The d2t/t2d file the tokenmap stage copies beside the capture (keys ``d2t``, ``t2d``)."""
    return Path(cfg.capture_dir) / f"d2t_t2d_{draft_vocab_size(cfg)}.safetensors"


def stage_dir(cfg: DictConfig, stage: str) -> Path:
    return {
        "capture": lambda: Path(cfg.capture_dir),
        "tokenmap": lambda: tokenmap_folder(cfg),
        "train": lambda: Path(cfg.head_dir),
        "eval": lambda: Path(cfg.eval_dir),
        "pipeline": lambda: Path(cfg.workdir),
    }[stage]()


def save_stage_config(cfg: DictConfig, stage: str) -> Path:
    """Write the resolved config as config.yaml beside the stage's outputs."""
    d = stage_dir(cfg, stage)
    d.mkdir(parents=True, exist_ok=True)
    path = d / "config.yaml"
    atomic_write_text(path, OmegaConf.to_yaml(cfg, resolve=True))
    return path


# ---------------------------------------------------------------------------------------------
# Tokenmap stage


def _corpus_texts(path: Path) -> Iterator[str]:
    """Texts of a corpus file: plain text (blocks of lines), or JSON / JSONL records that are
    strings, ``{"text": ...}`` objects or conversations (their assistant turns, else all turns)."""
    from eagle_train.data import normalize_conversation

    if not path.is_file():
        raise UserError(f"tokenmap corpus not found: {path}")
    if path.suffix not in (".json", ".jsonl"):
        with open(path, encoding="utf-8", errors="replace") as f:
            block: list[str] = []
            for line in f:
                block.append(line)
                if len(block) >= 64:
                    yield "".join(block)
                    block = []
            if block:
                yield "".join(block)
        return

    def records() -> Iterator[tuple[str, Any]]:
        if path.suffix == ".json":
            try:
                data = json.loads(path.read_text(encoding="utf-8"))
            except json.JSONDecodeError as e:
                raise UserError(f"{path} is not valid JSON: {e}") from None
            if not isinstance(data, list):
                raise UserError(f"{path}: expected a JSON array of records")
            for i, r in enumerate(data):
                yield f"{path} record {i}", r
            return
        with open(path, encoding="utf-8") as f:
            for n, line in enumerate(f, 1):
                if line.strip():
                    try:
                        yield f"{path}:{n}", json.loads(line)
                    except json.JSONDecodeError as e:
                        raise UserError(f"{path}:{n}: malformed JSON ({e.msg})") from None

    for where, r in records():
        if isinstance(r, str):
            yield r
        elif isinstance(r, dict) and isinstance(r.get("text"), str):
            yield r["text"]
        else:
            try:
                msgs = normalize_conversation(r)
            except ValueError as e:
                raise UserError(f"{where}: not a text or conversation record ({e})") from None
            texts = [m["content"] for m in msgs if m["role"] == "assistant"] or [m["content"] for m in msgs]
            yield from texts


def _source_fingerprint(cfg: DictConfig) -> dict:
    src = str(cfg.tokenmap.source)
    if src == "capture":
        from eagle_train.shards import read_manifest

        m = read_manifest(cfg.capture_dir)
        t = m.get("totals", {})
        return {"kind": "capture", "dir": str(cfg.capture_dir), "samples": t.get("samples", 0),
                "assistant_tokens": t.get("assistant_tokens", 0), "complete": bool(m.get("complete"))}
    p = Path(src)
    st = p.stat() if p.is_file() else None
    return {"kind": "corpus", "path": src, "bytes": st.st_size if st else None,
            "mtime": st.st_mtime if st else None}


def heldout_counts(cfg: DictConfig, vocab: int) -> Any:
    """Assistant-token counts of the capture's held-out split (greedy answers by default: the
    target's own greedy tokens on prompts the maps were not mined from), or None if it is empty."""
    import torch

    from eagle_train.shards import CaptureDataset
    from eagle_train.tokenmap import count_tokens

    try:
        ds = CaptureDataset(cfg.capture_dir, split="heldout")
    except (UserError, FileNotFoundError):
        return None
    if len(ds) == 0:
        return None
    counts = torch.zeros(vocab, dtype=torch.long)
    for ids, mask in ds.iter_token_shards():
        counts += count_tokens(ids, mask, vocab_size=vocab)
    return counts if int(counts.sum()) else None


def run_tokenmap(cfg: DictConfig) -> dict:
    """Count tokens (assistant tokens of the capture, or a corpus), mine the FR-Spec maps and the
    EAGLE-3 draft vocabulary, and copy d2t/t2d beside the capture for training (the warm-start
    head's own d2t/t2d instead when train.init_from is an EAGLE-3 head). Reports each map's
    coverage of the held-out answers too: mined coverage is optimistic (same tokens)."""
    import torch

    from eagle_train.tokenmap import count_corpus, count_tokens, coverage, load_token_map, mine_token_maps

    src = str(cfg.tokenmap.source)
    t0 = time.perf_counter()
    if src == "capture":
        from eagle_train.shards import CaptureDataset

        ds = CaptureDataset(cfg.capture_dir)
        if not ds.complete:
            log(f"warning: capture {cfg.capture_dir} is incomplete; counting the {len(ds)} samples "
                f"captured so far")
        if len(ds) == 0:
            raise UserError(f"capture {cfg.capture_dir} holds no samples: nothing to count")
        vocab = ds.vocab_size
        counts = torch.zeros(vocab, dtype=torch.long)
        for ids, mask in ds.iter_token_shards():
            counts += count_tokens(ids, mask, vocab_size=vocab)
        eos = ds.manifest.get("eos_token_ids") or []
        what = f"{int(counts.sum()):,} assistant tokens of {len(ds)} captured samples"
    else:
        from eagle_infer.default_model import resolve_model_path
        from eagle_infer.loader import load_tokenizer, read_hf_config
        from eagle_infer.model import ModelConfig

        path = Path(src)
        if not path.exists():
            raise UserError(f"tokenmap.source: corpus not found: {path} (or use tokenmap.source=capture)")
        mc = ModelConfig.from_hf(read_hf_config(resolve_model_path(cfg.model.path)))
        tok = load_tokenizer(cfg.model.path)
        vocab = mc.vocab_size
        counts = count_corpus(tok, _corpus_texts(path), vocab_size=vocab)
        eos = sorted(set(mc.eos_token_ids) | ({tok.eos_token_id} if tok.eos_token_id is not None else set()))
        what = f"{int(counts.sum()):,} tokens of corpus {path}"
    log(f"tokenmap: counted {what} in {time.perf_counter() - t0:.1f}s")

    dvs = draft_vocab_size(cfg)
    summary = mine_token_maps(counts, list(cfg.tokenmap.sizes), out_dir=cfg.tokenmap_dir,
                              model_name=str(cfg.model.name), eos_token_ids=eos, draft_vocab_size=dvs)
    mined = tokenmap_folder(cfg) / f"d2t_t2d_{dvs}.safetensors"
    dest = draft_vocab_file(cfg)
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = dest.with_name(dest.name + ".tmp")
    warm = init_head_vocab(cfg)
    if warm is None:
        shutil.copyfile(mined, tmp)
        vocab_from, t2d_used = "mined", None
    else:
        from safetensors.torch import save_file

        d2t_w, t2d_used, head = warm
        save_file({"d2t": d2t_w.contiguous(), "t2d": t2d_used.contiguous()}, str(tmp))
        vocab_from = str(head)
    tmp.replace(dest)
    if t2d_used is None:
        from safetensors.torch import load_file

        t2d_used = load_file(str(dest))["t2d"].bool()
    vocab_ids = t2d_used.nonzero().flatten()
    train_cov = coverage(counts, vocab_ids)
    held = heldout_counts(cfg, vocab) if src == "capture" else None
    held_cov: dict[str, float] = {}
    if held is not None:
        held_cov["draft_vocab"] = coverage(held, vocab_ids)
        for f in summary.get("files", []):
            if Path(f).name.startswith("frspec_"):
                held_cov[Path(f).stem] = coverage(held, load_token_map(f, vocab))
        if warm is not None:
            held_cov["draft_vocab_mined"] = coverage(held, _mined_ids(mined))
    record = {"source": _source_fingerprint(cfg), "sizes": sorted(int(s) for s in cfg.tokenmap.sizes),
              "draft_vocab_size": dvs, "draft_vocab_file": str(dest), "draft_vocab_from": vocab_from,
              "draft_vocab_train_coverage": train_cov, "heldout_coverage": held_cov,
              "heldout_tokens": int(held.sum()) if held is not None else 0, "summary": summary}
    atomic_write_json(Path(cfg.capture_dir) / TOKENMAP_RECORD, record)
    held_msg = (f", {held_cov['draft_vocab']:.2%} of the {int(held.sum()):,} held-out answer tokens"
                if held is not None else "")
    what = "mined here" if warm is None else f"the warm-start head's own, {vocab_from}"
    log(f"tokenmap: draft vocabulary ({dvs} ids, {what}; covers {train_cov:.2%} of the counted tokens"
        f"{held_msg}) copied to {dest}")
    if held_cov:
        log("tokenmap: held-out coverage " + ", ".join(f"{k} {v:.2%}" for k, v in held_cov.items()))
    return summary


def _mined_ids(path: Path) -> Any:
    from safetensors.torch import load_file

    return load_file(str(path))["t2d"].bool().nonzero().flatten()


def tokenmap_is_complete(cfg: DictConfig) -> bool:
    rec_path = Path(cfg.capture_dir) / TOKENMAP_RECORD
    if not rec_path.is_file():
        return False
    try:
        rec = json.loads(rec_path.read_text())
        fp = _source_fingerprint(cfg)
    except (json.JSONDecodeError, UserError, OSError):
        return False
    if rec.get("source") != fp or rec.get("draft_vocab_size") != draft_vocab_size(cfg):
        return False
    try:
        warm = init_head_vocab(cfg)
    except UserError:
        return False
    if rec.get("draft_vocab_from", "mined") != ("mined" if warm is None else str(warm[2])):
        return False
    if rec.get("sizes") != sorted(int(s) for s in cfg.tokenmap.sizes):
        return False
    files = [draft_vocab_file(cfg), *map(Path, rec.get("summary", {}).get("files", []))]
    return all(f.is_file() for f in files)


# ---------------------------------------------------------------------------------------------
# Dispatch


def stage_module(stage: str):
    """Import a stage's module lazily; a clear error when this checkout lacks it."""
    name = STAGE_MODULES[stage]
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as e:
        if e.name == name:
            raise UserError(f"stage '{stage}' is not available: module {name} is missing from this "
                            f"installation") from None
        raise


def is_stage_complete(stage: str, cfg: DictConfig) -> bool:
    if stage == "tokenmap":
        return tokenmap_is_complete(cfg)
    check = getattr(stage_module(stage), "is_complete", None)
    return bool(check(cfg)) if check is not None else False


def run_stage(stage: str, cfg: DictConfig) -> Any:
    if stage not in STAGES:
        raise UserError(f"unknown stage '{stage}': use one of {', '.join(STAGES)} or pipeline")
    mod = None if stage == "tokenmap" else stage_module(stage)
    if stage == "capture":
        # capture.run saves it once the existing capture (if any) has been checked against
        # these settings: a refused run must not overwrite the config of the data on disk.
        log(f"== stage {stage}")
    else:
        log(f"== stage {stage} (config saved to {save_stage_config(cfg, stage)})")
    if stage == "tokenmap":
        return run_tokenmap(cfg)
    return mod.run(cfg)


def cpu_name() -> str:
    """The CPU model (what a speedup on CPU depends on), from /proc/cpuinfo where there is one."""
    import platform

    from eagle_infer.loader import cpuinfo_field

    return cpuinfo_field("model name") or platform.processor() or platform.machine()


def run_bench(cfg: DictConfig) -> dict | None:
    """A short end-of-pipeline benchmark of the trained head: plain vs speculative greedy decoding
    (eagle_infer.bench) on the first ``stage.bench.num_prompts`` MT-bench prompts with a small
    tree (the device's default for the dtype that runs, TreeConfig.default_for, where the config
    leaves it null: on a CPU 2/4/6 in bf16 (1/4/4 without AVX512-BF16), 2/4/4 in fp32, with an
    n-gram branch of 4). Writes
    ``<workdir>/bench.json``; 0 prompts = off."""
    import torch

    from eagle_infer.bench import bench_plain_and_spec, compile_default, load_prompts
    from eagle_infer.heads import load_head_for
    from eagle_infer.loader import default_device, dtype_name, load_model, load_tokenizer, resolve_dtype
    from eagle_infer.tree import TreeConfig

    b = OmegaConf.select(cfg, "stage.bench")
    n = int(OmegaConf.select(cfg, "stage.bench.num_prompts", default=0) or 0)
    head_dir = Path(cfg.head_dir)
    if b is None or n <= 0 or not (head_dir / "config.json").is_file():
        return None
    device = resolve_device(cfg.device) or default_device()
    dtype = dtype_name(resolve_dtype(str(b.get("dtype", "auto")), device))
    # Like the stages, a rerun skips a bench already measured for this head with these settings.
    weights = head_dir / "model.safetensors"
    key = {"settings": OmegaConf.to_container(b, resolve=True), "dtype": dtype,
           "head_mtime_ns": weights.stat().st_mtime_ns if weights.is_file() else None}
    out = Path(cfg.workdir) / BENCH_FILE
    if out.is_file():
        try:
            old = json.loads(out.read_text())
        except json.JSONDecodeError:
            old = {}
        if old.get("key") == key and old.get("head") == str(head_dir):
            log(f"bench: {out} already measured this head with these settings, skipped")
            return old
    model_path = OmegaConf.select(cfg, "model.path")
    tok = load_tokenizer(model_path)
    prompts = load_prompts(None, n, tok)
    model = load_model(model_path, dtype, device)
    head = load_head_for(head_dir, model)
    given = [None if b.get(k) is None else int(b.get(k))
             for k in ("num_steps", "eagle_topk", "num_draft_tokens")]
    ngram = None if b.get("ngram_branch") is None else int(b.get("ngram_branch"))
    tree = TreeConfig.from_flags(*given, torch.device(device).type, "none", dtype, ngram)
    new = int(b.max_new_tokens)
    compiled = compile_default(device) if str(b.get("compile", "auto")) == "auto" else bool(b.compile)
    t0 = time.perf_counter()
    plain, spec, _ = bench_plain_and_spec(model, head, prompts, new, tree, compile_steps=compiled)
    plain_tps, spec_tps = plain.tokens_per_s, spec.result.tokens_per_s
    tau = spec.stats.acceptance_length()
    report = {"head": str(head_dir), "init_from": OmegaConf.select(cfg, "train.init_from"),
              "prompts": f"MT-bench first turns 1..{len(prompts)}", "max_new_tokens": new,
              "tree": [tree.num_steps, tree.eagle_topk, tree.num_draft_tokens],
              "ngram_branch": tree.ngram_branch,
              "dtype": dtype,
              "device": device, "cpu": cpu_name(), "threads": torch.get_num_threads(), "compiled": compiled,
              "timing": "interleaved: each prompt plain and speculative, the order reversed every other one",
              "warmup_s": round(plain.warmup_s + spec.result.warmup_s, 1),
              "plain_tokens_per_s": round(plain_tps, 3), "spec_tokens_per_s": round(spec_tps, 3),
              "speedup": round(spec_tps / plain_tps, 3) if plain_tps else None,
              "acceptance_length": round(tau, 3), "greedy_identical": spec.result.outputs == plain.outputs,
              "seconds": round(time.perf_counter() - t0, 1), "key": key}
    atomic_write_json(out, report)
    how = f", compiled steps ({report['warmup_s']} s of warm-up, not counted)" if compiled else ""
    log(f"bench: {len(prompts)} MT-bench prompts x {new} tokens, tree {tree.label()}, {dtype} on {device} "
        f"({report['cpu']}, {report['threads']} threads{how}): plain {plain_tps:.1f} tok/s, "
        f"speculative {spec_tps:.1f} tok/s = {report['speedup']}x, runtime tau {tau:.2f}; written to {out}")
    return report


def run_pipeline(cfg: DictConfig) -> dict[str, str]:
    """capture -> tokenmap -> train -> eval, skipping stages whose outputs are complete."""
    save_stage_config(cfg, "pipeline")
    # Fail before hours of capture when a later stage's module is missing.
    for stage in ("train", "eval"):
        stage_module(stage)
    done: dict[str, str] = {}
    t_all = time.perf_counter()
    for stage in STAGES:
        if is_stage_complete(stage, cfg):
            log(f"== stage {stage}: outputs in {stage_dir(cfg, stage)} are complete, skipped")
            done[stage] = "skipped"
            continue
        t0 = time.perf_counter()
        run_stage(stage, cfg)
        done[stage] = f"{time.perf_counter() - t0:.1f}s"
    t0 = time.perf_counter()
    bench = run_bench(cfg)
    if bench is not None:
        done["bench"] = f"{time.perf_counter() - t0:.1f}s"
    log(f"pipeline finished in {time.perf_counter() - t_all:.1f}s: "
        + ", ".join(f"{k} {v}" for k, v in done.items()))
    summarize(cfg, bench)
    return done


def summarize(cfg: DictConfig, bench: dict | None) -> None:
    """The result a newcomer looks for, in two lines: where the head came from, its held-out tau,
    and what the benchmark measured."""
    ev_path = Path(cfg.eval_dir) / "eval.json"
    ev = json.loads(ev_path.read_text()) if ev_path.is_file() else {}
    init = OmegaConf.select(cfg, "train.init_from")
    origin = (f"warm-started from {init} and adapted on this data "
              f"(from scratch: train.init_from=null train.lr=3e-4)" if init else "trained from scratch")
    tau = ev.get("acceptance_length")
    msg = f"result: head {cfg.head_dir}, {origin}; held-out chain tau " + (f"{tau:.3f}" if tau else "n/a")
    if bench is not None:
        msg += (f"; runtime tau {bench['acceptance_length']:.2f} and speedup {bench['speedup']}x vs plain "
                f"(tree {'/'.join(map(str, bench['tree']))}"
                + (f" with an n-gram branch of {bench['ngram_branch']}" if bench.get("ngram_branch") else "")
                + f", {bench['dtype']}, {bench['cpu']})")
    log(msg)


def main_task(raw_cfg: DictConfig) -> Any:
    """What `python -m eagle_train` runs once Hydra has composed the config."""
    cfg = prepare_config(raw_cfg)
    stage = str(cfg.stage.name)
    if stage == "pipeline":
        return run_pipeline(cfg)
    if stage in TOOL_STAGES:  # act on a finished head; not part of the pipeline
        return importlib.import_module(TOOL_STAGES[stage]).run(cfg)
    return run_stage(stage, cfg)
