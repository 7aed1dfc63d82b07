"""`bench goodput --plot`: the attainment curve, the share of requests meeting both targets against
the request rate, with the goal and the goodput marked (one PNG)."""

from __future__ import annotations

from collections.abc import Sequence


def plot_attainment(curve: Sequence[dict], goal: float, goodput_req_s: float, path: str, title: str) -> None:
    """`curve`: {"rate_req_s", "attainment", "requests"} per probe, sorted by rate. ImportError
    without matplotlib."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5), dpi=120)
    rates = [c["rate_req_s"] for c in curve]
    ax.plot(rates, [c["attainment"] for c in curve], marker="o", color="tab:blue", label="attainment")
    for c in curve:
        ax.annotate(str(c["requests"]), (c["rate_req_s"], c["attainment"]), textcoords="offset points",
                    xytext=(4, 4), fontsize=7, color="gray")
    ax.axhline(goal, color="tab:red", linestyle="--", label=f"goal {goal:g}")
    if goodput_req_s > 0:
        ax.axvline(goodput_req_s, color="tab:green", linestyle=":", label=f"goodput {goodput_req_s:g} req/s")
    ax.set_xlabel("request rate, requests/s (Poisson arrivals)")
    ax.set_ylabel("share of requests meeting TTFT and ITL targets")
    ax.set_ylim(-0.02, 1.02)
    ax.set_xlim(left=0)
    ax.grid(True, alpha=0.3)
    ax.legend(loc="lower left", fontsize=8)
    ax.set_title(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
