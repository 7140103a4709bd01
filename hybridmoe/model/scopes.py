"""Names of the jax named scopes the training step's parts run under.

Each op a scope encloses carries its name in the compiled program's metadata (op_name, the name
stack), through remat, scans and autodiff (a transposed op keeps its primal op's scopes), so
`inspect` can attribute the buffers live at the memory peak to what made them
(analysis/peak_memory.py). Plain strings: a scope is a label, not a behaviour.
"""

EMBEDDING = "embedding"        # the token embedding lookup
LAYERS = "layers"              # the layer stack's loop (the scan over blocks): its carries and stacks
LAYER_WEIGHTS = "layer_weights"  # a layer's weights made ready for use (FSDP gather, fp8 fake quant)
ATTENTION = "attention"        # the gated attention token mixer (the layer kind's name)
GDN = "gdn"                    # the Gated DeltaNet token mixer (the layer kind's name)
MOE = "moe"                    # the routed-expert block (router, row gather, grouped matmuls, combine)
GROUPED_MATMUL = "grouped_matmul"  # inside MOE: the routed experts' matmuls (analysis/hlo_cost.py's category)
# The attention and GDN cores open their own scopes (CORE_SCOPE in kernels/attention and kernels/gdn:
# kernels import nothing from model/), read by analysis/hlo_cost.py the same way.
LM_HEAD = "lm_head"            # the output projection and the per-token log-probs
MICRO_BATCHES = "micro_batches"  # the gradient accumulation loop over micro-batches
OPTIMIZER = "optimizer"        # the optimizer's update of the parameters and its state
