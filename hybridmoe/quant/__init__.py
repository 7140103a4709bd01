"""fp8, in one place.

fp8.py: the format as pure array functions: power-of-two scales, codes, dequantization, fake
quantization. expert_fp8.py: the routed experts' weight transform (fake quantization where the
weights are used, its hoisted absmax and gather8 codes, written with shard_map over the device
mesh) and `LayerWeights`, the one hook through which the model reads its layer weights.
gmm_fp8.py: the fp8 grouped matmul (quant.fp8_gmm), a custom VJP over kernels/gmm's backends.
"""

from hybridmoe.quant.expert_fp8 import LayerWeights

__all__ = ["LayerWeights"]
