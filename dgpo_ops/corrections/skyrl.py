"""SkyRL's ``trainer.algorithm.off_policy_correction`` (skyrl 0.3.0,
``skyrl/backends/skyrl_train/utils/off_policy_correction_utils.py: compute_off_policy_correction``), applied inside
every SkyRL policy loss when any of its parts is set. On ``r = exp(clamp(old - rollout, +-20))``, in order, each
step on the mask the previous ones left:

1. outlier rejection: a response with any scored token's ``r`` above ``outlier_token_is_threshold_high`` or below
   ``_low`` (each optional) is rejected;
2. per-token rejection (both ``token_mask_is_threshold_low`` and ``_high`` set): tokens with ``r`` outside
   ``[token_mask_is_threshold_low, token_mask_is_threshold_high]`` are rejected (``compute_token_mask``);
3. TIS: ``min(r, token_tis_ratio_clip_high)`` per token, or ``min(exp(clamp(sum r's logs, +-20)),
   sequence_tis_ratio_clip_high)`` per response (the product, over the tokens not yet rejected);
4. sequence rejection: the geometric mean (``exp(clamp(mean log r, +-20))``) outside ``[geo_mask_low,
   geo_mask_high]``, or the product outside ``[product_mask_low, product_mask_high]``: the response is rejected.

A rejected token gets weight 0 and stays in the mask: SkyRL's trainer divides by the mini-batch's tokens before
the correction (``apply_loss_reduction_to_advantages_minibatch`` scales the advantages by them), then its policy
loss multiplies by the corrected ``loss_mask`` and sums, so a rejection leaves the numerator and not the
denominator."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dgpo_ops.corrections.core import (CorrectionInputs, CorrectionResult, RolloutCorrection, check_number,
                                       check_order, clamped_exp)

# The values tis_ratio_type and sequence_mask_metric take (besides None) are these tables' keys, so none is
# without its branch. Each tis_ratio_type's weights from (the inputs on the mask the rejections left, the
# log-ratio, the clamped ratio, the correction):
TIS_WEIGHTS = {
    "token": lambda now, log_ratio, ratio, c: ratio.clamp(max=c.token_tis_ratio_clip_high),
    "sequence": lambda now, log_ratio, ratio, c: now.to_tokens(
        clamped_exp(now.sequence_sum(log_ratio, "SkyRL's sequence TIS")).clamp(max=c.sequence_tis_ratio_clip_high)),
}
# each sequence_mask_metric's log statistic of a response, and the fields of its bounds (low, high)
SEQUENCE_MASKS = {
    "geometric": (lambda now, log_ratio: now.sequence_mean(log_ratio, "SkyRL's sequence mask"),
                  "geo_mask_low", "geo_mask_high"),
    "product": (lambda now, log_ratio: now.sequence_sum(log_ratio, "SkyRL's sequence mask"),
                "product_mask_low", "product_mask_high"),
}


@dataclass(frozen=True)
class SkyRLCorrection(RolloutCorrection):
    """SkyRL's ``off_policy_correction`` fields, with its defaults."""

    tis_ratio_type: str | None = None  # "token" | "sequence"
    token_tis_ratio_clip_high: float = 2.0
    sequence_tis_ratio_clip_high: float = 5.0
    sequence_mask_metric: str | None = None  # "geometric" | "product"
    geo_mask_high: float = 1.01
    geo_mask_low: float = 0.99
    product_mask_high: float = 2.0
    product_mask_low: float = 0.5
    outlier_token_is_threshold_low: float | None = None
    outlier_token_is_threshold_high: float | None = None
    token_mask_is_threshold_low: float | None = None
    token_mask_is_threshold_high: float | None = None

    def __post_init__(self):
        if self.tis_ratio_type is not None and self.tis_ratio_type not in TIS_WEIGHTS:
            raise ValueError(f"tis_ratio_type must be 'token', 'sequence' or None, got {self.tis_ratio_type!r}")
        if self.sequence_mask_metric is not None and self.sequence_mask_metric not in SEQUENCE_MASKS:
            raise ValueError(f"sequence_mask_metric must be 'geometric', 'product' or None, got "
                             f"{self.sequence_mask_metric!r}")
        if (self.tis_ratio_type is None and self.sequence_mask_metric is None
                and self.outlier_token_is_threshold_low is None and self.outlier_token_is_threshold_high is None
                and self.token_mask_is_threshold_low is None):
            raise ValueError("SkyRL applies its off-policy correction only with tis_ratio_type, "
                             "sequence_mask_metric, an outlier_token_is_threshold or the token_mask_is_thresholds "
                             "set (off_policy_correction_enabled)")
        for name in ("token_tis_ratio_clip_high", "sequence_tis_ratio_clip_high"):  # a weight <= 0 flips the loss
            check_number(name, getattr(self, name), positive=True)
        for name in ("geo_mask_high", "geo_mask_low", "product_mask_high", "product_mask_low"):
            check_number(name, getattr(self, name), minimum=0.0)
        for name in ("outlier_token_is_threshold_low", "outlier_token_is_threshold_high",
                     "token_mask_is_threshold_low", "token_mask_is_threshold_high"):
            check_number(name, getattr(self, name), optional=True)
        for low, high in (("geo_mask_low", "geo_mask_high"), ("product_mask_low", "product_mask_high"),
                          ("outlier_token_is_threshold_low", "outlier_token_is_threshold_high"),
                          ("token_mask_is_threshold_low", "token_mask_is_threshold_high")):
            check_order(low, getattr(self, low), high, getattr(self, high))
        if (self.token_mask_is_threshold_low is None) != (self.token_mask_is_threshold_high is None):
            raise ValueError("token_mask_is_threshold_low and token_mask_is_threshold_high go together: SkyRL "
                             "applies its per-token mask only with both set and silently ignores one alone")

    def check_options(self, options) -> None:
        self.check_gspo_token(options)
        rejects = (self.sequence_mask_metric is not None or self.token_mask_is_threshold_low is not None
                   or self.outlier_token_is_threshold_low is not None
                   or self.outlier_token_is_threshold_high is not None)
        if rejects and options.folds_rollout_weights:
            # the stage hands a rejection to the routes as a weight 0 the normaliser still counts; folded into the
            # method's sequence statistic (its log) it would change the whole response's term, where SkyRL drops
            # the token's term alone (dgpo_ops.integrations.skyrl drops it after the loss)
            raise ValueError(f"{options.method.name} folds the rollout weights into its sequence statistic, where "
                             "SkyRL's rejections (the outlier, token and sequence masks) would change the whole "
                             "response's term; SkyRL has no such method: use its TIS alone (tis_ratio_type) with it")

    def check_gspo_token(self, options) -> None:
        """SkyRL's gspo is GSPO-token: each token's ratio carries its own log-prob's gradient, so a per-token
        weight scales that token's gradient alone, where GSPO's differentiated sequence ratio would spread it
        over the response."""
        per_token = self.tis_ratio_type == "token" or self.token_mask_is_threshold_low is not None
        if per_token and options.importance_sampling_level == "sequence":
            raise ValueError("SkyRL's gspo is GSPO-token, where a per-token weight (tis_ratio_type='token' or the "
                             "token_mask_is_thresholds) scales each token's own gradient; "
                             "importance_sampling_level='sequence' differentiates the response's mean log-ratio and "
                             "would give other gradients: use a per-response correction (tis_ratio_type='sequence', "
                             "the outlier or sequence masks) with it")

    def __call__(self, x: CorrectionInputs) -> CorrectionResult:
        log_ratio = x.log_ratio
        ratio = clamped_exp(log_ratio)
        mask = x.mask
        low, high = self.outlier_token_is_threshold_low, self.outlier_token_is_threshold_high
        if low is not None or high is not None:
            outside = torch.zeros_like(mask)
            if high is not None:
                outside = outside | (ratio > high)
            if low is not None:
                outside = outside | (ratio < low)
            bad = x.sequence_sum((outside & mask).float(), "SkyRL's outlier rejection") > 0
            mask = mask & ~x.to_tokens(bad)
        if self.token_mask_is_threshold_low is not None:
            mask = mask & (ratio >= self.token_mask_is_threshold_low) & (ratio <= self.token_mask_is_threshold_high)
        now = x._replace(mask=mask)
        weights = None
        if self.tis_ratio_type is not None:
            weights = TIS_WEIGHTS[self.tis_ratio_type](now, log_ratio, ratio, self)
        if self.sequence_mask_metric is not None:
            statistic, low_field, high_field = SEQUENCE_MASKS[self.sequence_mask_metric]
            value = clamped_exp(statistic(now, log_ratio))
            lower, upper = getattr(self, low_field), getattr(self, high_field)
            mask = mask & now.to_tokens((value <= upper) & (value >= lower))
        # rejected: weight 0, still counted by the normaliser (a NaN ratio stays NaN, as in SkyRL's loss)
        kept = mask.to(torch.float32)
        return CorrectionResult(weights=kept if weights is None else weights * kept)
