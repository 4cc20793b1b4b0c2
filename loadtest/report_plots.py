"""PNG plots of a loadtest.report results dict (matplotlib, Agg backend, 150 dpi).

    draw_all(results, out_dir) -> {plot name: file name, ..., "error": "..." if any failed}

Each plot is independent: one that cannot be drawn (its scenario failed or was not run) is left
out and the reason recorded, the others are still written.
"""
from __future__ import annotations

import math
import traceback
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.lines import Line2D  # noqa: E402
from matplotlib.patches import Patch  # noqa: E402
from matplotlib.ticker import FixedLocator, FuncFormatter, NullLocator, ScalarFormatter  # noqa: E402

DPI = 150
STYLE = {"font.size": 12, "axes.titlesize": 13, "axes.labelsize": 12, "legend.fontsize": 10.5,
         "xtick.labelsize": 11, "ytick.labelsize": 11, "figure.titlesize": 15, "axes.grid": True,
         "grid.alpha": 0.3, "axes.spines.top": False, "axes.spines.right": False}
POLICY_COLORS = {"round_robin": "#7f7f7f", "least_loaded": "#1f77b4", "prefix_affinity": "#d62728"}
ROUTER_COLORS = {1: "#1f77b4", 3: "#ff7f0e"}
CONTENDER_STYLE = {"direct": ("#2ca02c", "o", 2.6), "proxy": ("#d62728", "s", 2.6), "passthrough": ("#7f7f7f", "^", 1.5),
                   "vllm-router": ("#9467bd", "D", 1.5), "sglang-router": ("#8c564b", "v", 1.5)}
EXTRA = ["#17becf", "#bcbd22", "#e377c2", "#ff7f0e"]


def _policy_color(policy: str, k: int) -> str:
    return POLICY_COLORS.get(policy, EXTRA[k % len(EXTRA)])


def _cells(results: dict) -> list[dict]:
    aff = results.get("scenarios", {}).get("affinity") or {}
    if "error" in aff or not aff.get("cells"):
        raise LookupError("affinity scenario has no cells")
    return aff["cells"]


def _order(values) -> list:
    seen: dict = {}
    for v in values:
        seen.setdefault(v, None)
    return list(seen)


def _shape_title(results: dict, shape: str) -> str:
    s = (results.get("scenarios", {}).get("affinity") or {}).get("sizing", {}).get(shape)
    return f"shape '{shape}'" + (f" ({s['tenants']} tenants, Zipf {s['skew']})" if s else "")


def _nice(v: float) -> str:
    """Plain tick labels: 0.05, 0.5, 2, 300, 4k, 50k."""
    if v >= 1000:
        return f"{v / 1000:g}k"
    return f"{v:g}"


def _log_ticks(lo: float, hi: float) -> list[float]:
    """1-2-5 ticks covering [lo, hi] on a log axis."""
    out = []
    for e in range(math.floor(math.log10(lo)) - 1, math.ceil(math.log10(hi)) + 1):
        for m in (1, 2, 5):
            v = m * 10 ** e
            if lo <= v <= hi:
                out.append(v)
    return out


def _save(fig, out: Path, name: str) -> str:
    fig.savefig(out / name, dpi=DPI, bbox_inches="tight", facecolor="white")
    plt.close(fig)
    return name


# --- affinity: hit rate vs the pooled bound --------------------------------------------------------
def hit_rate(results: dict, out: Path) -> str:
    cells = _cells(results)
    shapes = _order(c["shape"] for c in cells)
    policies = _order(c["policy"] for c in cells)
    routers = sorted(_order(c["routers"] for c in cells))
    by = {(c["shape"], c["policy"], c["routers"]): c for c in cells}
    fig, axes = plt.subplots(1, len(shapes), figsize=(6.2 * len(shapes), 5.4), squeeze=False, sharey=True)
    width = 0.8 / len(routers)
    for ax, shape in zip(axes[0], shapes):
        for j, r in enumerate(routers):
            for i, policy in enumerate(policies):
                c = by.get((shape, policy, r))
                x = i - 0.4 + width * (j + 0.5)
                if c is None:
                    ax.text(x, 0.02, "no data (cell failed)", rotation=90, ha="center", va="bottom", fontsize=9.5)
                    continue
                ax.bar(x, c["hit_rate"], width * 0.92, color=ROUTER_COLORS.get(r, EXTRA[j % len(EXTRA)]),
                       edgecolor="black", linewidth=0.6, zorder=2)
                ax.hlines(c["bound"], x - width * 0.46, x + width * 0.46, colors="black", linewidth=2.5, zorder=3)
                ax.text(x, c["hit_rate"] / 2, f"{c['share_of_bound']:.0%}\nof\nbound", ha="center",
                        va="center", fontsize=9.5, color="white", fontweight="bold", zorder=4)
        ax.set_xticks(range(len(policies)))
        ax.set_xticklabels([p.replace("_", " ") for p in policies])
        ax.set_xlim(-0.55, len(policies) - 0.45)
        ax.set_xlabel("routing policy")
        ax.set_title(_shape_title(results, shape))
        ax.set_ylim(0, 1.05)
        ax.grid(axis="x", visible=False)
    axes[0][0].set_ylabel("fleet prefix-cache hit rate (share of prompt tokens)")
    handles = [Patch(facecolor=ROUTER_COLORS.get(r, EXTRA[j % len(EXTRA)]), edgecolor="black",
                     label=f"hit rate, {r} prox{'y' if r == 1 else 'ies'}") for j, r in enumerate(routers)]
    handles.append(Line2D([], [], color="black", linewidth=2.5, label="pooled bound (one fleet-sized LRU)"))
    fig.legend(handles=handles, loc="lower center", ncol=len(handles), bbox_to_anchor=(0.5, -0.04), frameon=False)
    fig.suptitle("Prefix-cache hit rate vs the pooled bound, per routing policy")
    fig.tight_layout(rect=(0, 0.05, 1, 1))
    return _save(fig, out, "affinity_hit_rate.png")


# --- affinity: TTFT CDFs ----------------------------------------------------------------------------
def ttft_cdf(results: dict, out: Path) -> str:
    cells = _cells(results)
    if not any(c.get("ttft_ms_samples") for c in cells):
        raise LookupError("no per-request TTFT samples in the affinity cells")
    shapes = _order(c["shape"] for c in cells)
    policies = _order(c["policy"] for c in cells)
    routers = sorted(_order(c["routers"] for c in cells))
    by = {(c["shape"], c["policy"], c["routers"]): c for c in cells}
    allv = [v for c in cells for v in c.get("ttft_ms_samples") or () if v > 0]
    lo, hi = min(allv), max(allv)
    fig, axes = plt.subplots(len(shapes), len(routers), figsize=(6.2 * len(routers), 4.4 * len(shapes)),
                             squeeze=False, sharex=True, sharey=True)
    for a, shape in enumerate(shapes):
        for b, r in enumerate(routers):
            ax = axes[a][b]
            for k, policy in enumerate(policies):
                c = by.get((shape, policy, r))
                if not c or not c.get("ttft_ms_samples"):
                    continue
                xs = sorted(c["ttft_ms_samples"])
                ys = [(i + 1) / len(xs) for i in range(len(xs))]
                ax.step(xs, ys, where="post", color=_policy_color(policy, k), linewidth=2,
                        label=f"{policy.replace('_', ' ')} (p50 {c['ttft_p50_ms']:.0f} ms, p99 {c['ttft_p99_ms']:.0f} ms)")
            ax.set_xscale("log")
            ax.set_xlim(lo * 0.8, hi * 1.25)
            ax.set_ylim(0, 1.02)
            ax.axhline(0.5, color="black", linewidth=0.6, linestyle=":")
            ax.axhline(0.99, color="black", linewidth=0.6, linestyle=":")
            ax.set_title(f"{_shape_title(results, shape)}, {r} prox{'y' if r == 1 else 'ies'}")
            ax.legend(loc="lower right", fontsize=9.5)
            if a == len(shapes) - 1:
                ax.set_xlabel("time to first token (ms, log scale)")
            if b == 0:
                ax.set_ylabel("share of requests ≤ TTFT")
            ax.xaxis.set_major_locator(FixedLocator(_log_ticks(lo * 0.8, hi * 1.25)))
            ax.xaxis.set_minor_locator(NullLocator())
            ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _: _nice(v)))
            ax.tick_params(axis="x", which="both", labelbottom=a == len(shapes) - 1)
    fig.suptitle("TTFT distribution per routing policy (client side, streaming)")
    fig.tight_layout()
    return _save(fig, out, "affinity_ttft_cdf.png")


# --- affinity: requests per replica ----------------------------------------------------------------
def load_per_replica(results: dict, out: Path) -> str:
    cells = _cells(results)
    shapes = _order(c["shape"] for c in cells)
    policies = _order(c["policy"] for c in cells)
    routers = sorted(_order(c["routers"] for c in cells))
    by = {(c["shape"], c["policy"], c["routers"]): c for c in cells}
    replicas = max(len(c["requests_per_replica"]) for c in cells)
    cmap = plt.get_cmap("tab10")
    fig, axes = plt.subplots(len(shapes), len(routers), figsize=(6.2 * len(routers), 4.2 * len(shapes)),
                             squeeze=False, sharey=True)
    width = 0.8 / replicas
    for a, shape in enumerate(shapes):
        for b, r in enumerate(routers):
            ax = axes[a][b]
            for i, policy in enumerate(policies):
                c = by.get((shape, policy, r))
                if not c:
                    ax.text(i, 0, "no data\n(cell failed)", ha="center", va="bottom", fontsize=9.5)
                    continue
                counts = c["requests_per_replica"]
                for k, n in enumerate(counts):
                    ax.bar(i - 0.4 + width * (k + 0.5), n, width * 0.9, color=cmap(k), edgecolor="black",
                           linewidth=0.5, zorder=2)
                mean = sum(counts) / len(counts)
                ax.hlines(mean, i - 0.42, i + 0.42, colors="black", linestyles="--", linewidth=1.2, zorder=3)
                ax.text(i, max(counts) * 1.02, f"max/mean {c['max_over_mean']:.2f}", ha="center", va="bottom",
                        fontsize=9.5)
            ax.set_xticks(range(len(policies)))
            ax.set_xticklabels([p.replace("_", " ") for p in policies])
            ax.set_xlim(-0.55, len(policies) - 0.45)
            ax.set_title(f"{_shape_title(results, shape)}, {r} prox{'y' if r == 1 else 'ies'}")
            ax.grid(axis="x", visible=False)
            ax.margins(y=0.15)
            if b == 0:
                ax.set_ylabel("requests served (count)")
            if a == len(shapes) - 1:
                ax.set_xlabel("routing policy")
    handles = [Patch(facecolor=cmap(k), edgecolor="black", label=f"replica {k}") for k in range(replicas)]
    handles.append(Line2D([], [], color="black", linestyle="--", label="mean per replica"))
    fig.legend(handles=handles, loc="lower center", ncol=len(handles), bbox_to_anchor=(0.5, -0.02), frameon=False)
    fig.suptitle("Load per replica: requests each simulated replica served, per routing policy")
    fig.tight_layout(rect=(0, 0.04, 1, 1))
    return _save(fig, out, "affinity_load_per_replica.png")


# --- overhead vs concurrency ------------------------------------------------------------------------
def overhead_concurrency(results: dict, out: Path) -> str:
    ov = results.get("scenarios", {}).get("overhead") or {}
    if "error" in ov or not ov.get("summary"):
        raise LookupError("overhead scenario has no results")
    sweep = [s for s in ov["config"]["scenarios"] if not s["stream"]]
    sweep.sort(key=lambda s: s["connections"])
    conns = [s["connections"] for s in sweep]
    fig, (left, right) = plt.subplots(1, 2, figsize=(13, 5.6))
    box = dict(boxstyle="round,pad=0.15", facecolor="white", edgecolor="none", alpha=0.7)
    rps_all, p50_all = [], []
    for k, (name, summary) in enumerate(ov["summary"].items()):
        color, marker, lw = CONTENDER_STYLE.get(name, (EXTRA[k % len(EXTRA)], "o", 1.5))
        pts = [(s["connections"], summary[s["name"]]) for s in sweep if s["name"] in summary]
        if not pts:
            continue
        xs = [c for c, _ in pts]
        errs = any(v["errors"] for _, v in pts)
        label = name + (" (errors!)" if errs else "")
        style = dict(color=color, marker=marker, linewidth=lw, markersize=7 if lw > 2 else 5, label=label,
                     zorder=3 if lw > 2 else 2)
        left.plot(xs, [v["rps"] for _, v in pts], **style)
        right.plot(xs, [v["p50_ms"] for _, v in pts], **style)
        rps_all += [v["rps"] for _, v in pts]
        p50_all += [v["p50_ms"] for _, v in pts]
        if name in ("direct", "proxy"):
            up = name == "direct"  # direct: labels above its throughput, below its latency; proxy: mirrored
            for x, v in pts:
                left.annotate(_nice(float(f"{v['rps']:.2g}")) + " rps", (x, v["rps"]), textcoords="offset points",
                              xytext=(0, 8 if up else -8), ha="center", va="bottom" if up else "top", fontsize=9.5,
                              color=color, bbox=box, zorder=5)
                right.annotate(f"{v['p50_ms']:.2g} ms", (x, v["p50_ms"]), textcoords="offset points",
                               xytext=(0, -8 if up else 8), ha="center", va="top" if up else "bottom", fontsize=9.5,
                               color=color, bbox=box, zorder=5)
    for ax, values in ((left, rps_all), (right, p50_all)):
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.xaxis.set_major_locator(FixedLocator(conns))
        ax.xaxis.set_minor_locator(NullLocator())
        ax.xaxis.set_major_formatter(ScalarFormatter())
        ax.set_xlim(conns[0] / 1.6, conns[-1] * 1.6)
        lo, hi = min(values) / 1.6, max(values) * 1.6
        ax.set_ylim(lo, hi)
        ax.yaxis.set_major_locator(FixedLocator(_log_ticks(lo, hi)))
        ax.yaxis.set_minor_locator(NullLocator())
        ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: _nice(v)))
        ax.set_xlabel("concurrent connections (wrk -c, log scale)")
    left.set_ylabel("throughput (requests/s, log scale)")
    left.set_title("Throughput vs concurrency")
    right.set_ylabel("median latency p50 (ms, log scale)")
    right.set_title("Median latency vs concurrency")
    handles, labels = left.get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=len(labels), bbox_to_anchor=(0.5, -0.02), frameon=False)
    cfg = ov["config"]
    fig.suptitle(f"Forwarding overhead: plain chat requests to a fast fake backend "
                 f"(median of {cfg['rounds']} round{'s' if cfg['rounds'] != 1 else ''} x {cfg['duration_s']} s per point)")
    fig.tight_layout(rect=(0, 0.06, 1, 1))
    return _save(fig, out, "overhead_concurrency.png")


PLOTS = {"affinity_hit_rate": hit_rate, "affinity_ttft_cdf": ttft_cdf,
         "affinity_load_per_replica": load_per_replica, "overhead_concurrency": overhead_concurrency}


def draw_all(results: dict, out: Path) -> dict:
    drawn: dict = {}
    problems = []
    with plt.rc_context(STYLE):
        for name, fn in PLOTS.items():
            try:
                drawn[name] = fn(results, out)
            except LookupError as exc:
                problems.append(f"{name}: {exc}")
            except Exception:  # noqa: BLE001 - one bad plot must not lose the others
                problems.append(f"{name}: {traceback.format_exc().strip().splitlines()[-1]}")
                plt.close("all")
    if problems:
        drawn["error"] = "; ".join(problems)
    return drawn

