"""One colour and line style per method (and per SAPO gate), shared by every figure: the psi(r)
atlas and the training comparisons. No two entries share a colour."""

from __future__ import annotations

STYLES: dict[str, tuple[str, object]] = {
    "dgpo": ("#d62728", "-"),
    "grpo": ("#1f77b4", "-"),
    "dapo": ("#17becf", "--"),
    "cispo": ("#2ca02c", "-"),
    "dispo": ("#8c564b", "--"),
    "gppo": ("#ff7f0e", "-"),
    "ce_gppo": ("#bcbd22", "--"),
    "aspo": ("#9467bd", "-"),
    "dcpo": ("#e377c2", "-."),
    "sapo": ("#000000", ":"),
    "sapo sigmoid": ("#000000", ":"),
    "sapo erf": ("#7f7f7f", "-."),
    "sapo arctan": ("#000080", (0, (5, 1))),
    "sapo softsign": ("#b8860b", (0, (3, 1, 1, 1))),
}


def style(key: str) -> dict:
    """Matplotlib keyword arguments for a method (``"dgpo"``) or a SAPO gate (``"sapo erf"``)."""
    if key not in STYLES:
        raise KeyError(f"no style for {key!r}; add it to dgpo_ops.styles.STYLES")
    color, linestyle = STYLES[key]
    return dict(color=color, linestyle=linestyle)
