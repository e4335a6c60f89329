"""ms-swift 4.6: its rollout importance sampling (TRL's four mode names, its own math); its GRPO trainer divides as
TRL's, so it has no aggregation row of its own."""

from __future__ import annotations

from dgpo_ops.corrections.swift import SwiftCorrection
from dgpo_ops.frameworks.core import FrameworkSpec

SPEC = FrameworkSpec(name="ms_swift", title="ms-swift", correction=SwiftCorrection,
                     correction_config="GRPO arguments (rollout_importance_sampling_*)")
