"""Gated DeltaNet core kernel: chunked sequence form, single-token decode step, recurrent oracle."""

from hybridmoe.kernels.gdn.ops import BACKENDS, gated_delta_rule, gated_delta_step

__all__ = ["BACKENDS", "gated_delta_rule", "gated_delta_step"]
