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
PATH_KEYS = ("workdir", "capture_dir", "tokenmap_dir", "head_dir", "eval_dir")
TOKENMAP_RECORD = "tokenmap.json"
DEFAULT_DRAFT_VOCAB = 8192


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
    OmegaConf.set_struct(out, True)
    return out


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


def run_tokenmap(cfg: DictConfig) -> dict:
    """Count tokens (assistant tokens of the capture, or a corpus), mine the FR-Spec maps and the
    EAGLE-3 draft vocabulary, and copy d2t/t2d beside the capture for training."""
    import torch

    from eagle_train.tokenmap import count_corpus, count_tokens, mine_token_maps

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
    shutil.copyfile(mined, tmp)
    tmp.replace(dest)
    record = {"source": _source_fingerprint(cfg), "sizes": sorted(int(s) for s in cfg.tokenmap.sizes),
              "draft_vocab_size": dvs, "draft_vocab_file": str(dest), "summary": summary}
    atomic_write_json(Path(cfg.capture_dir) / TOKENMAP_RECORD, record)
    log(f"tokenmap: draft vocabulary ({dvs} ids, coverage "
        f"{summary['draft_vocab_coverage'].get(str(dvs), 0.0):.2%}) copied to {dest}")
    return summary


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
    log(f"pipeline finished in {time.perf_counter() - t_all:.1f}s: "
        + ", ".join(f"{k} {v}" for k, v in done.items()))
    return done


def main_task(raw_cfg: DictConfig) -> Any:
    """What `python -m eagle_train` runs once Hydra has composed the config."""
    cfg = prepare_config(raw_cfg)
    stage = str(cfg.stage.name)
    if stage == "pipeline":
        return run_pipeline(cfg)
    return run_stage(stage, cfg)
