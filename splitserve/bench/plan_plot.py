"""`bench plan --plot`: load, replicas and latency of a planner simulation over time (one PNG)."""

from __future__ import annotations

import numpy as np


def plot_plan(result, static, config, path: str, title: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tl = result.timeline
    t = np.array([p.t_s for p in tl]) / 60
    interval = config.interval_s
    fig, axes = plt.subplots(4, 1, figsize=(9, 10), sharex=True)
    ax = axes[0]
    ax.plot(t, [p.arrivals / interval for p in tl], label="arrivals")
    ax.plot(t, [p.plan_rate_rps for p in tl], label=f"planned (p{config.arrival_quantile * 100:g} forecast)",
            linestyle="--")
    ax.set_ylabel("requests / s")
    ax = axes[1]
    for name, active, ready, color in (("prefill", "prefill_active", "prefill_ready", "C0"),
                                       ("decode", "decode_active", "decode_ready", "C1")):
        ax.step(t, [getattr(p, active) for p in tl], where="post", color=color, label=f"{name} (ready + starting)")
        ax.step(t, [getattr(p, ready) for p in tl], where="post", color=color, linestyle=":", label=f"{name} ready")
    if static:
        ax.axhline(static.prefill, color="C0", alpha=0.4, linestyle="--", label=f"static prefill {static.prefill}")
        ax.axhline(static.decode, color="C1", alpha=0.4, linestyle="--", label=f"static decode {static.decode}")
    ax.set_ylabel("workers")
    ax = axes[2]
    ax.plot(t, [p.ttft_p90_s for p in tl], label="TTFT p90 of the interval")
    ax.axhline(config.ttft_target_s, color="k", linestyle="--", label="target")
    ax.set_ylabel("TTFT (s)")
    ax = axes[3]
    ax.plot(t, np.array([p.itl_mean_s for p in tl]) * 1e3, label="mean ITL of requests done in the interval")
    ax.axhline(config.itl_target_s * 1e3, color="k", linestyle="--", label="target")
    ax.set_ylabel("ITL (ms)")
    ax.set_xlabel("minutes")
    for ax in axes:
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=7, loc="upper left")
    axes[0].set_title(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
