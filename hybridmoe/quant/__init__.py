"""Quantization as pure array functions (no model, no mesh): fp8.py holds the fp8 scales, codes,
dequantization and fake quantization that the routed experts (quant/expert_fp8.py) and the fp8
grouped matmul (kernels/gmm/fp8.py) are built on."""
