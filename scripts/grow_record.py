"""Record one grow segment of scripts/grow_heads.sh (issue #14, item 3).

Every evaluated segment goes into results/grow_segments.json (published or not: a segment that
did not measurably improve tau is still a measurement); with --publish it is also appended to
heads/<target>-<kind>/grow_segments.json, the provenance of the head that segment produced.

    python scripts/grow_record.py --kind eagle3 --segment 2 --offset 2352 --limit 512 \\
        --data onpolicy --segment-dir runs/grow/seg2 --capture runs/grow/seg2/capture-onpolicy
"""

from __future__ import annotations

import argparse
import filecmp
import json
import sys
from pathlib import Path

TARGET = "SmolLM2-135M-Instruct"
RESULTS = Path("results/grow_segments.json")


def read(path: Path) -> dict | list:
    return json.loads(path.read_text())


def tokens_seen_before(head: Path) -> int:
    """Training tokens the committed head had seen: the reference recipe's captures (its
    train_summary, before a first published segment replaces it), then each published segment's."""
    log = head / "grow_segments.json"
    if log.exists():
        return read(log)[-1]["tokens_seen"]
    return read(head / "train_summary.json")["fingerprint"]["capture_tokens"]


def lineage_tokens(kind: str, segments: list[int]) -> int:
    """New tokens of unpublished segments the run's head descends from (it started from one of
    their heads, not from the committed head): their captures count as data this head has seen."""
    records = read(RESULTS) if RESULTS.exists() else []
    total = 0
    for seg in segments:
        rec = next((r for r in records
                    if r["kind"] == kind and r["segment"] == seg and not r.get("run")), None)
        if rec is None:
            sys.exit(f"--lineage-segment {seg}: {RESULTS} has no {kind} record of segment {seg}")
        total += rec["capture"]["tokens"] - rec.get("replayed_tokens_est", 0)
    return total


def segment_record(kind: str, args: argparse.Namespace) -> dict:
    grown = Path(args.segment_dir) / kind
    summary = read(grown / "train_summary.json")
    totals = read(Path(args.capture) / "manifest.json")["totals"]
    tr = summary["fingerprint"]["train"]
    # "before" is the head the run started from: the committed one, unless it was trained from an
    # older head (one checked out of git to rerun an earlier segment); a path only the training
    # machine had falls back to the committed head.
    init = Path(tr.get("init_from") or "")
    head = init if (init / "eval.json").is_file() else Path(f"heads/{TARGET}-{kind}")
    weights = grown / "model.safetensors", head / "model.safetensors"
    if all(w.is_file() for w in weights) and filecmp.cmp(*weights, shallow=False):
        sys.exit(f"{head} already holds {grown}'s weights: its eval.json is the 'before' of this "
                 f"record, so record (and --publish) before copying the grown head there")
    after = read(Path(args.segment_dir) / f"eval-{kind}" / "eval.json")
    lineage = lineage_tokens(kind, args.lineage_segment)
    return {
        "kind": kind, "segment": args.segment, "conversations": [args.offset, args.offset + args.limit],
        "capture": {"data": args.data, **totals}, "epochs": summary.get("epochs_done", tr.get("epochs")),
        "lr": tr.get("lr"), "batch_size": tr.get("batch_size"), "warmup_ratio": tr.get("warmup_ratio"),
        "device": summary.get("device", "cpu"), "run": args.run,
        "steps": summary["step"], "token_passes": summary["tokens_total"],
        "train_seconds_last_run": summary["train_seconds_this_run"],
        # Replayed conversations (prompts and answer prefixes a published segment already held)
        # are not new data: the data-scaling curve counts what is.
        "tokens_seen": tokens_seen_before(head) + lineage + totals["tokens"] - args.replayed_tokens,
        **({"replayed_tokens_est": args.replayed_tokens} if args.replayed_tokens else {}),
        **({"lineage_segments": args.lineage_segment, "lineage_tokens": lineage} if lineage else {}),
        **({"note": args.note} if args.note else {}),
        "heldout_tau_before": read(head / "eval.json")["acceptance_length"],
        "heldout_tau_after": after["acceptance_length"],
        "top1_per_position_after": after["top1_per_position"],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--kind", required=True, choices=["eagle3", "eagle2"])
    ap.add_argument("--segment", type=int, required=True)
    ap.add_argument("--offset", type=int, required=True)
    ap.add_argument("--limit", type=int, required=True)
    ap.add_argument("--data", required=True, choices=["onpolicy", "tf"])
    ap.add_argument("--segment-dir", required=True)
    ap.add_argument("--capture", required=True)
    ap.add_argument("--run", default="", help="a letter for another training run on the same segment "
                    "(its record is kept beside the first's: 9, 9b, ...)")
    ap.add_argument("--replayed-tokens", type=int, default=0,
                    help="captured tokens an earlier segment already held (replayed prompts and answer "
                    "prefixes), left out of tokens_seen")
    ap.add_argument("--lineage-segment", type=int, action="append", default=[],
                    help="an unpublished segment whose head this run continued from (repeatable): "
                    "its new tokens count in tokens_seen")
    ap.add_argument("--note", default="", help="what the conversations range leaves unsaid")
    ap.add_argument("--publish", action="store_true")
    args = ap.parse_args()

    head_log = Path(f"heads/{TARGET}-{args.kind}/grow_segments.json")
    published = read(head_log) if head_log.exists() else []
    if any(s["segment"] == args.segment for s in published):
        sys.exit(f"{head_log} already records segment {args.segment}: it was published "
                 f"(the head in {head_log.parent} is its output)")
    rec = segment_record(args.kind, args)
    if args.publish:
        head_log.write_text(json.dumps(published + [rec], indent=1) + "\n")
    records = read(RESULTS) if RESULTS.exists() else []
    def key(r: dict) -> tuple:  # records before --run existed have no "run"
        return r["kind"], r["segment"], r.get("run", "")

    records = [r for r in records if key(r) != key(rec)] + [{**rec, "published": args.publish}]
    records = sorted(records, key=key)
    RESULTS.write_text(json.dumps(records, indent=1) + "\n")
    print(f"{args.kind}: segment {args.segment}{args.run} held-out tau {rec['heldout_tau_before']:.3f} -> "
          f"{rec['heldout_tau_after']:.3f}" + (" (published)" if args.publish else ""))


if __name__ == "__main__":
    main()
