"""Training-inference mismatch corrections: a stage of the loss op that turns the inference engine's per-token
log-probs (``rollout_logps``) into weights on the policy term and rejections from the mask, with each framework's
modes under its own names (docs/corrections.md): one module per framework family over a shared core."""

from dgpo_ops.corrections.areal import ArealCorrection, decoupled_ppo, m2po
from dgpo_ops.corrections.core import CorrectionInputs, CorrectionResult, RolloutCorrection
from dgpo_ops.corrections.skyrl import SkyRLCorrection
from dgpo_ops.corrections.swift import SwiftCorrection
from dgpo_ops.corrections.tis import NemoRLCorrection, OpenRLHFCorrection
from dgpo_ops.corrections.trl import TrlCorrection
from dgpo_ops.corrections.verl import VerlCorrection

__all__ = ["ArealCorrection", "CorrectionInputs", "CorrectionResult", "NemoRLCorrection", "OpenRLHFCorrection",
           "RolloutCorrection", "SkyRLCorrection", "SwiftCorrection", "TrlCorrection", "VerlCorrection",
           "decoupled_ppo", "m2po"]
