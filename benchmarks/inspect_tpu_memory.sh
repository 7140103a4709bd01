#!/bin/sh
# Per-device memory of the training step of the two large recipes compiled for TPU v7x
# topologies from a CPU host (compile-only devices; needs libtpu: pip install 'jax[tpu]').
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
# 397B on the seed's 128 devices (64 chips), one 4096-token sequence per device: the default
# (experts gathered over fsdp 128) vs the MoE levers with the experts on an 8-way expert axis;
# the MoE levers alone, to show what expert parallelism adds; then every memory lever together
# (those two + fp8 expert weights gathered as 1-byte codes + the Pallas GDN core).
P397="recipe=qwen3.5-397b-a17b train.batch_size=128 --target tpu7x:4x4x4"
TILES_397="kernels.gmm.tk=2048 kernels.gmm.tn=512 kernels.gmm.wi_fwd_tile_n_per_half=512"
python -m hybridmoe inspect $P397 --compare $MOE_LEVERS $TILES_397 mesh.expert=8 \
  --out benchmarks/records/inspect_qwen3.5-397b-a17b_tpu7x-4x4x4.json
python -m hybridmoe inspect $P397 $MOE_LEVERS $TILES_397 \
  --out benchmarks/records/inspect_qwen3.5-397b-a17b_tpu7x-4x4x4_moe_levers_only.json
python -m hybridmoe inspect $P397 $MOE_LEVERS $TILES_397 mesh.expert=8 \
  quant.fp8_moe_fake_quant=true quant.fp8_fake_quant_hoist=gather8 kernels.gdn.backend=pallas_tpu \
  --out benchmarks/records/inspect_qwen3.5-397b-a17b_tpu7x-4x4x4_all_levers.json
