"""Gather the runs of scripts/data_scaling.sh into results/data_scaling.json and a PNG.

Per point: the training set (conversations, tokens, assistant tokens: the positions with a
loss), the token-passes training made, and the held-out greedy chain tau with top-1 per
position. Per head kind a power law is fitted to the accepted drafts per round, tau - 1 =
c * D^alpha over the training tokens D (prompts and answers, as the shipped heads' records
count them), and solved for the data at which the trend reaches issue #14's offline goal
(tau 2.5): an extrapolation of one recipe, not a promise.

    python scripts/plot_data_scaling.py [--workdir runs/i14/scale] [--out results/data_scaling]

Without the workdir it redraws from the last --out JSON, with results/grow_segments.json re-read.
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

GOAL_TAU = 2.5


def read_json(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return None


def capture_totals(dirs: list[Path]) -> dict:
    out = {"samples": 0, "tokens": 0, "assistant_tokens": 0}
    for d in dirs:
        t = (read_json(d / "manifest.json") or {}).get("totals", {})
        for k in out:
            out[k] += int(t.get(k, 0))
    return out


def point(head_dir: Path, eval_dir: Path) -> dict | None:
    """One trained and evaluated head, or None while it is not finished."""
    summary, ev = read_json(head_dir / "train_summary.json"), read_json(eval_dir / "eval.json")
    if not (summary and summary.get("finished") and ev):
        return None
    tr = summary["fingerprint"]["train"]
    dirs = [Path(p) for p in capture_dirs(head_dir)]
    return {
        "head": str(head_dir),
        "kind": summary["kind"],
        "captures": [d.name for d in dirs],
        "train_set": capture_totals(dirs),
        "epochs": tr.get("epochs"),
        "lr": tr.get("lr"),
        "init_from": tr.get("init_from"),
        "token_passes": summary.get("tokens_total"),
        "steps": summary.get("step"),
        "train_seconds": summary.get("train_seconds_this_run"),
        "tau": ev["acceptance_length"],
        "top1_per_position": ev["top1_per_position"],
        "heldout_start_positions": ev["num_start_positions"],
    }


def capture_dirs(head_dir: Path) -> list[str]:
    """capture_dir and train.extra_captures from the config the train stage saved."""
    from omegaconf import OmegaConf

    cfg = OmegaConf.load(head_dir / "config.yaml")
    return [str(cfg.capture_dir), *[str(p) for p in (cfg.train.extra_captures or [])]]


def power_fit(xs: list[float], taus: list[float]) -> dict | None:
    """Least squares of log(tau - 1) on log(x): tau - 1 = c * x^alpha."""
    pts = [(math.log(x), math.log(t - 1)) for x, t in zip(xs, taus) if x > 0 and t > 1]
    if len(pts) < 2:
        return None
    n = len(pts)
    mx, my = sum(p[0] for p in pts) / n, sum(p[1] for p in pts) / n
    sxx = sum((p[0] - mx) ** 2 for p in pts)
    alpha = sum((p[0] - mx) * (p[1] - my) for p in pts) / sxx
    c = math.exp(my - alpha * mx)
    goal = (GOAL_TAU - 1) / c
    return {"c": c, "alpha": alpha, "tokens_for_goal_tau":
            goal ** (1 / alpha) if alpha > 0 else None, "goal_tau": GOAL_TAU}


def from_runs(w: Path) -> tuple[dict, dict, dict]:
    """The from-scratch curves, the capture-temperature pair and the shipped heads' points, read
    from the data-scaling workdir."""
    curves: dict[str, list[dict]] = {}
    for kind in ("eagle3", "eagle2"):
        pts = []
        for k in range(1, 100):
            if not (w / f"{kind}-tf{k}").is_dir():
                break
            p = point(w / f"{kind}-tf{k}", w / f"eval-{kind}-tf{k}")
            if p:
                pts.append(p)
        curves[kind] = pts
    temperature = {}
    n = len(curves["eagle3"])
    for t in ("t07", "t0"):
        p = point(w / f"eagle3-tf{n}-{t}", w / f"eval-eagle3-tf{n}-{t}")
        if p:
            temperature[t] = p
    shipped = {}
    for kind in ("eagle3", "eagle2"):
        ev = read_json(w / f"eval-{kind}-shipped" / "eval.json")
        head = Path(f"heads/SmolLM2-135M-Instruct-{kind}")
        summ = read_json(head / "train_summary.json")
        # A published segment of scripts/grow_heads.sh replaces the head's records; the reference
        # recipe's point is then the first published segment's starting point.
        published = read_json(head / "grow_segments.json") or []
        if ev and summ:
            base = published[0]["tokens_seen"] - published[0]["capture"]["tokens"] if published else \
                summ["fingerprint"]["capture_tokens"]
            shipped[kind] = {"tau": ev["acceptance_length"], "top1_per_position": ev["top1_per_position"],
                             "capture_tokens": base,
                             "note": "reference recipe: 700 steps on an on-policy capture, then 420 on it "
                                     "and a teacher-forced one (scripts/reference_heads.sh)"}
    return curves, temperature, shipped


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workdir", default="runs/i14/scale")
    ap.add_argument("--out", default="results/data_scaling")
    args = ap.parse_args()
    w = Path(args.workdir)
    if w.is_dir():
        curves, temperature, shipped = from_runs(w)
        workdir = str(w)
    else:  # a fresh machine: the last results JSON has them; the grow segments are re-read below
        prev = read_json(Path(args.out + ".json"))
        if prev is None:
            raise SystemExit(f"error: neither {w} nor {args.out}.json exists: run scripts/data_scaling.sh")
        curves, temperature, shipped, workdir = (prev[k] for k in ("curves", "temperature", "shipped",
                                                                   "workdir"))
    grown: dict[str, list[dict]] = {}
    # Every evaluated segment, published or not (scripts/grow_record.py).
    for g in read_json(Path("results/grow_segments.json")) or []:
        grown.setdefault(g["kind"], []).append(
            {k: g[k] for k in ("segment", "conversations", "tokens_seen", "heldout_tau_before",
                               "heldout_tau_after", "steps", "epochs", "lr", "published")}
            | {"data": g["capture"]["data"], "capture_tokens": g["capture"]["tokens"],
               # new to the heads: a segment that replays conversations counts only what is new
               "new_tokens": g["capture"]["tokens"] - g.get("replayed_tokens_est", 0),
               # tokens of unpublished segments the head continued from: the line starts at the
               # committed head it was measured against
               "lineage_tokens": g.get("lineage_tokens", 0),
               "label": f"{g['segment']}{g.get('run', '')}"})
    fits = {k: power_fit([p["train_set"]["tokens"] for p in v], [p["tau"] for p in v])
            for k, v in curves.items()}
    # The same law through the largest from-scratch point and the shipped head, which trained
    # ~10x longer on ~9x the data: the small points are step-starved (12-82 optimizer steps).
    through_shipped = {k: power_fit([curves[k][-1]["train_set"]["tokens"], shipped[k]["capture_tokens"]],
                                    [curves[k][-1]["tau"], shipped[k]["tau"]])
                       for k in curves if curves[k] and k in shipped}
    out = {"workdir": workdir, "fits_through_shipped": through_shipped,
           "heldout": "greedy answers of the target (capture-t07/heldout)",
           "curves": curves, "fits": fits, "temperature": temperature, "shipped": shipped,
           "grown": grown}
    Path(args.out + ".json").write_text(json.dumps(out, indent=1) + "\n")

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7.5, 4.5))
    x_end = 1.2e7
    for kind, marker in (("eagle3", "o"), ("eagle2", "s")):
        pts = curves[kind]
        if not pts:
            continue
        xs = [p["train_set"]["tokens"] for p in pts]
        line = ax.plot(xs, [p["tau"] for p in pts], marker=marker, label=f"{kind}, from scratch, 2 epochs")[0]
        f = fits[kind]
        if f:
            grid = [min(xs) * (x_end / min(xs)) ** (i / 50) for i in range(51)]
            ax.plot(grid, [1 + f["c"] * g ** f["alpha"] for g in grid], ls=":", color=line.get_color(),
                    label=f"{kind} fit: tau-1 = {f['c']:.3g} D^{f['alpha']:.2f}")
        if kind in shipped:
            ax.scatter([shipped[kind]["capture_tokens"]], [shipped[kind]["tau"]], marker="*", s=140,
                       color=line.get_color(), zorder=3, label=f"{kind} shipped (reference recipe)")
        for i, g in enumerate(grown.get(kind, [])):  # each segment: from its starting head to its result
            x0 = g["tokens_seen"] - g["new_tokens"] - g["lineage_tokens"]
            ax.plot([x0, g["tokens_seen"]], [g["heldout_tau_before"], g["heldout_tau_after"]], lw=0.8,
                    ls="-" if g["published"] else ":", color=line.get_color())
            ax.scatter([g["tokens_seen"]], [g["heldout_tau_after"]], marker="P", s=60, zorder=3,
                       color=line.get_color() if g["published"] else "none", edgecolors=line.get_color(),
                       label=None if i else f"{kind} + grow segment N (hollow: not published)")
            ax.annotate(g["label"], (g["tokens_seen"], g["heldout_tau_after"]),
                        fontsize=7, xytext=(4, -3), textcoords="offset points", color=line.get_color())
        f2 = through_shipped.get(kind)
        if f2:
            grid = [xs[-1] * (x_end / xs[-1]) ** (i / 50) for i in range(51)]
            ax.plot(grid, [1 + f2["c"] * g ** f2["alpha"] for g in grid], ls="--", lw=0.9,
                    color=line.get_color(), label=f"{kind} through shipped: D^{f2['alpha']:.2f}")
    base = curves["eagle3"][-1]["train_set"]["tokens"] if curves["eagle3"] else 0
    for t, p in temperature.items():
        ax.scatter([base + p["train_set"]["tokens"]], [p["tau"]], marker="^" if t == "t07" else "v",
                   zorder=3, label=f"eagle3 largest + on-policy T={'0.7' if t == 't07' else '0'}")
    ax.axhline(GOAL_TAU, color="grey", lw=0.8, ls="--", label=f"issue #14 goal tau {GOAL_TAU}")
    ax.set_xscale("log")
    ax.set_ylim(1.0, 3.0)
    ax.set_xlabel("training tokens D (teacher-forced ShareGPT; prompts + answers)")
    ax.set_ylabel("held-out greedy chain tau (7 drafts)")
    ax.set_title("SmolLM2-135M-Instruct: held-out tau against training data")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(args.out + ".png", dpi=120)
    print("| head | training set | conversations | tokens | assistant tokens | steps | held-out tau "
          "| top-1 at positions 1 / 2 / 3 |")
    print("|---|---|---|---|---|---|---|---|")
    rows = [(k, p) for k, v in curves.items() for p in v] + [("eagle3", p) for p in temperature.values()]
    for kind, p in rows:
        t = p["train_set"]
        print(f"| {kind} | {'+'.join(p['captures'])}{' (warm)' if p['init_from'] else ''} | {t['samples']} "
              f"| {t['tokens']:,} | {t['assistant_tokens']:,} | {p['steps']} | {p['tau']:.3f} | "
              + " / ".join(f"{x:.2f}" for x in p["top1_per_position"][:3]) + " |")
    for kind, sh in shipped.items():
        print(f"| {kind} shipped | reference recipe | | {sh['capture_tokens']:,} | | | {sh['tau']:.3f} | "
              + " / ".join(f"{x:.2f}" for x in sh["top1_per_position"][:3]) + " |")
    for kind, gs in grown.items():
        for g in gs:
            print(f"| {kind} + segment {g['label']} ({g['data']}, "
                  f"conversations {g['conversations'][0]}-"
                  f"{g['conversations'][1] - 1}{'' if g['published'] else ', not published'}) | | "
                  f"+ {g['new_tokens']:,}" + (f" (of {g['capture_tokens']:,} captured)"
                                              if g["new_tokens"] != g["capture_tokens"] else "")
                  + f" | | + {g['steps']} | {g['heldout_tau_after']:.3f} | |")
    print(json.dumps(fits))
    print(json.dumps(through_shipped))


if __name__ == "__main__":
    main()
