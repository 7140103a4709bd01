#!/bin/sh
# Per-device memory of the Qwen3.5-35B training step compiled for a TPU v7x topology from a CPU host (compile-only devices; needs libtpu: pip install 'jax[tpu]').
# Each writes a JSON record here. A step the TPU compiler refuses for HBM is recorded with the
# compiler's temporaries figure (refusals come within minutes; a step that fits compiles for
# ~20-35 min on a 2-core host).
set -e
cd "$(dirname "$0")/.."
MOE_LEVERS="moe.wi_fused_swiglu=true moe.wo_fused_dswiglu=true moe.router_grad_from_wo_input=true
            kernels.gmm.backend=pallas_tpu kernels.gmm.tiling=explicit kernels.gmm.tm=512"
# 35B on 4 chips (8 devices): default vs the MoE levers on the Pallas TPU kernels.
python -m hybridmoe inspect recipe=qwen3.5-35b-a3b --target tpu7x:2x2x1 \
  --compare $MOE_LEVERS kernels.gmm.tk=2048 kernels.gmm.tn=512 kernels.gmm.wi_fwd_tile_n_per_half=512 \
  --out benchmarks/records/inspect_qwen3.5-35b-a3b_tpu7x-2x2x1.json
# The 397B cell (tpu7x:4x4x8, lever by lever): benchmarks/seed_cell.py.
