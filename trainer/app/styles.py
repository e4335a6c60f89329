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
    # tab20b's darker shades: the spare colours below ran out
    "rollout_is": ("#5254a3", "--"),
    "prime_dppo": ("#843c39", "-"),
    "prime_ipo": ("#e7ba52", "-."),
    "topr": ("#637939", ":"),
    "fipo": ("#7b4173", "--"),
}


# Colours for a method the table gains without an entry above (adding a method needs no figure code):
# the light half of matplotlib's tab20, none of them used above.
SPARE_COLOURS = ("#aec7e8", "#ffbb78", "#98df8a", "#ff9896", "#c5b0d5", "#c49c94", "#f7b6d2", "#c7c7c7",
                 "#dbdb8d", "#9edae5")


def style(key: str) -> dict:
    """Matplotlib keyword arguments for a method (``"dgpo"``) or a SAPO gate (``"sapo erf"``)."""
    if key in STYLES:
        color, linestyle = STYLES[key]
        return dict(color=color, linestyle=linestyle)
    from dgpo_ops.methods.catalog import POLICY_LOSSES

    unstyled = [name for name in POLICY_LOSSES if name not in STYLES]
    if key in unstyled:
        return dict(color=SPARE_COLOURS[unstyled.index(key) % len(SPARE_COLOURS)], linestyle="-")
    raise KeyError(f"no style for {key!r}: neither a policy loss of the method table nor an entry of "
                   f"dgpo_ops.trainer.app.styles.STYLES")
