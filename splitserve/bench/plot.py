"""The Pareto view of a `splitserve bench serve` sweep: frontier and PNG.

Owns the throughput-vs-interactivity picture InferenceMAX draws: x = output tokens/s per user
(how fast one stream decodes), y = output tokens/s per GPU (how much the hardware yields), one
point per concurrency level. It knows nothing about HTTP, gRPC or how the numbers were measured;
it takes the per-level summary dicts that `serve.summarize_level` returns.
"""

from __future__ import annotations

from collections.abc import Sequence

X_KEY = "output_tok_s_per_user"
Y_KEY = "output_tok_s_per_gpu"


def pareto_frontier(points: Sequence[tuple[float, float]]) -> list[int]:
    """Indices of the points that no other point beats on both x and y (higher is better).

    Returned in increasing x. A point equal to another on both axes keeps only the first of them;
    a point that ties on one axis and loses on the other is dominated.
    """
    order = sorted(range(len(points)), key=lambda i: (-points[i][0], -points[i][1], i))
    frontier: list[int] = []
    best_y = float("-inf")
    for i in order:  # walk from the most interactive point; keep each that raises the best y
        if points[i][1] > best_y:
            frontier.append(i)
            best_y = points[i][1]
    return frontier[::-1]


def frontier_levels(levels: Sequence[dict]) -> list[dict]:
    """The levels on the Pareto frontier (levels whose x or y is missing are left out)."""
    usable = [lv for lv in levels if lv.get(X_KEY) is not None and lv.get(Y_KEY) is not None]
    idx = pareto_frontier([(lv[X_KEY], lv[Y_KEY]) for lv in usable])
    return [usable[i] for i in idx]


def plot_pareto(levels: Sequence[dict], path: str, title: str) -> None:
    """Write a PNG: one labelled point per level, the frontier as a line."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    usable = [lv for lv in levels if lv.get(X_KEY) is not None and lv.get(Y_KEY) is not None]
    fig, ax = plt.subplots(figsize=(7, 5), dpi=120)
    ax.scatter([lv[X_KEY] for lv in usable], [lv[Y_KEY] for lv in usable], color="tab:blue", zorder=3)
    for lv in usable:
        label = f"c={lv['concurrency']}" if lv.get("concurrency") is not None else "replay"
        ax.annotate(label, (lv[X_KEY], lv[Y_KEY]), textcoords="offset points", xytext=(5, 5), fontsize=8)
    front = frontier_levels(usable)
    if len(front) > 1:
        ax.plot([lv[X_KEY] for lv in front], [lv[Y_KEY] for lv in front], color="tab:orange",
                label="Pareto frontier", zorder=2)
        ax.legend(loc="upper right")
    ax.set_xlabel("interactivity: output tok/s per user")
    ax.set_ylabel("throughput: output tok/s per GPU")
    ax.set_title(title, fontsize=10)
    ax.grid(True, alpha=0.3)
    ax.set_xlim(left=0)
    ax.set_ylim(bottom=0)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
