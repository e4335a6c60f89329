"""The psi(r) atlas: gradient weights of every method, straight from the method table (``dgpo-ops table``,
``dgpo-ops plot``; ``python -m bench.report`` draws ``bench/plots/psi_atlas.png`` with it)."""

from __future__ import annotations

import math

import torch

from dgpo_ops.methods.base import MethodConfig
from dgpo_ops.methods.catalog import required_params
from dgpo_ops.methods.table import GATES, METHODS, method_config, token_terms
from dgpo_ops.trainer.app.styles import style

# One curve per row; sapo appears once per gate.
ATLAS_METHODS: list[tuple[str, dict]] = [(name, required_params(name)) for name in METHODS if name != "sapo"] + [
    ("sapo", {"gate": gate}) for gate in GATES
]
OLD_PROB = 0.5


def label(name: str, params: dict) -> str:
    """The curve's name: the method's, and the parameters that pick a variant (sapo's gate), not those it needs
    a value for (dro's dro_beta)."""
    required = required_params(name)
    return name + "".join(f" {v}" for k, v in params.items() if k not in required)


def psi_curve(cfg: MethodConfig, ratios: torch.Tensor, advantage: float, old_prob: float = OLD_PROB) -> torch.Tensor:
    ratios = ratios.to(torch.float64)
    return token_terms(  # a token's own psi: no token is scored for a batch-level selection (clip_cov's cut)
        cfg, ratios.log(), torch.full_like(ratios, advantage), torch.full_like(ratios, math.log(old_prob)),
        scored=torch.zeros_like(ratios, dtype=torch.bool)).psi


def psi_table(ratios=(0.05, 0.5, 0.79, 0.8, 0.9, 1.0, 1.1, 1.2, 1.21, 2.0, 5.0)) -> str:
    """Plain-text psi(r) for every method at A = +1 and A = -1 (old probability 0.5)."""
    ratios_t = torch.tensor(ratios, dtype=torch.float64)
    header = f"{'method':<18}{'A':>3} " + "".join(f"{r:>8g}" for r in ratios)
    lines = ["psi(r): gradient weight, dL/dl = -A psi (old probability 0.5)", header, "-" * len(header)]
    for name, params in ATLAS_METHODS:
        cfg = method_config(name, **params)
        for adv in (1.0, -1.0):
            psi = psi_curve(cfg, ratios_t, adv)
            lines.append(f"{label(name, params):<18}{adv:>+3.0f} " + "".join(f"{v:>8.3f}" for v in psi.tolist()))
    return "\n".join(lines)


def plot_atlas(path: str) -> str:
    """Write the atlas PNG: psi(r) for A > 0 and A < 0, and DGPO's W = psi/pi against pi."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ratios = torch.logspace(math.log10(0.02), math.log10(4.0), 600, dtype=torch.float64)
    rows = math.ceil(len(ATLAS_METHODS) / 6)  # small multiples, six a row: as many rows as the table needs
    fig = plt.figure(figsize=(18, 8.3 + 2.1 * rows))
    grid = fig.add_gridspec(2 + rows, 6, height_ratios=[2.6, 0.45] + [1] * rows)
    axes = [fig.add_subplot(grid[0, 2 * i:2 * i + 2]) for i in range(3)]
    for ax, adv in zip(axes[:2], (1.0, -1.0)):
        for name, params in ATLAS_METHODS:
            psi = psi_curve(method_config(name, **params), ratios, adv)
            ax.plot(ratios, psi, label=label(name, params), lw=2.2 if name == "dgpo" else 1.4,
                    **style(label(name, params)))
        for edge in (0.8, 1.2):
            ax.axvline(edge, color="grey", lw=0.6, ls=":")
        ax.set(xscale="log", ylim=(-0.1, 3.2), xlabel="importance ratio r", ylabel="psi (dL/dl = -A psi)",
               title=f"A {'> 0' if adv > 0 else '< 0'}: gradient weight psi(r)")
    # One legend for both psi panels, below the figure, readable: every method its own colour and dash.
    handles, labels = axes[0].get_legend_handles_labels()
    legend_ax = fig.add_subplot(grid[1, :])
    legend_ax.axis("off")
    legend_ax.legend(handles, labels, loc="center", ncol=7, fontsize=10, frameon=False)
    # Small multiples: each method alone, A > 0 solid and A < 0 dashed, where overlapping curves
    # above (grpo, cispo and gppo agree inside the trust region) cannot hide one another.
    for i, (name, params) in enumerate(ATLAS_METHODS):
        ax = fig.add_subplot(grid[2 + i // 6, i % 6])
        cfg = method_config(name, **params)
        color = style(label(name, params))["color"]
        ax.plot(ratios, psi_curve(cfg, ratios, 1.0), color=color, lw=1.5, label="A > 0")
        ax.plot(ratios, psi_curve(cfg, ratios, -1.0), color=color, lw=1.5, ls="--", label="A < 0")
        for edge in (0.8, 1.2):
            ax.axvline(edge, color="grey", lw=0.6, ls=":")
        ax.set(xscale="log", ylim=(-0.1, 3.2))
        ax.set_title(label(name, params), fontsize=10, color=color)
        ax.tick_params(labelsize=8)
        if i == 0:
            ax.legend(fontsize=8, loc="upper left")

    ax = axes[2]
    q = OLD_PROB
    small = torch.logspace(-6, 0, 400, dtype=torch.float64)  # pi = r q
    # grpo's W is 0 left of the boundary (hard clip), so it has no curve on a log axis.
    for (name, params), linestyle in zip(
        [("gppo", {}), ("cispo", {"eps_low": 0.2, "eps_high": 0.2}), ("dgpo", {"n": 1.0}), ("dgpo", {"n": 2.0})],
        ["-", "-", "-", "--"],
    ):
        w = psi_curve(method_config(name, **params), small / q, -1.0) / small
        ax.plot(small, w, label=label(name, params), color=style(name)["color"], linestyle=linestyle, lw=1.6)
    ax.axvline((1 - 0.2) * q, color="grey", lw=0.6, ls=":")
    ax.set(xscale="log", yscale="log", ylim=(1e-7, 1e7), xlabel="pi_theta(o_t)", ylabel="W = psi / pi",
           title="A < 0, left side: probability-gradient weight (q = 0.5)")
    ax.legend(fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
