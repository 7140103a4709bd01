#!/bin/sh
# Per-device memory of the training step of the two large recipes compiled for TPU v7x
# topologies from a CPU host (compile-only devices; needs libtpu: pip install 'jax[tpu]').
# Default program vs the MoE levers on the Pallas TPU kernels. Each writes a JSON record here.
# The compiles are long (the 35B step alone takes ~9 min on an idle 2-core host).
set -e
cd "$(dirname "$0")/.."
LEVERS="moe.wi_fused_swiglu=true moe.wo_fused_dswiglu=true moe.router_grad_from_wo_input=true
        kernels.gmm.backend=pallas_tpu kernels.gmm.tiling=explicit kernels.gmm.tm=512"
python -m hybridmoe inspect recipe=qwen3.5-35b-a3b --target tpu7x:2x2x1 \
  --compare $LEVERS kernels.gmm.tk=2048 kernels.gmm.tn=512 kernels.gmm.wi_fwd_tile_n_per_half=512 \
  --out benchmarks/inspect_qwen3.5-35b-a3b_tpu7x-2x2x1.json
python -m hybridmoe inspect recipe=qwen3.5-397b-a17b train.batch_size=128 --target tpu7x:4x4x4 \
  --compare $LEVERS kernels.gmm.tk=4096 kernels.gmm.tn=1024 kernels.gmm.wi_fwd_tile_n_per_half=1024 \
  --out benchmarks/inspect_qwen3.5-397b-a17b_tpu7x-4x4x4.json
