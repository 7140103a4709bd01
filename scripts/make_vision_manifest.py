"""Write tests/fixtures/hf_layouts/vision_tensors.json: the names and shapes of a tiny Qwen3.5-MoE
vision tower as transformers declares them, so the tests can build a published-layout multimodal
checkpoint (tests/hf_layouts.py) with the project's own writers and transformers still loads it as
Qwen3_5MoeForConditionalGeneration with no missing or unexpected tensor.

Needs torch and transformers (never dependencies of the package); run it with the reference venv:
  REFVENV/bin/python scripts/make_vision_manifest.py [OUT]
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import transformers

# Small, and consistent with the text fixture (out_hidden_size = its hidden_size 64).
VISION_CONFIG = {"depth": 2, "hidden_size": 32, "intermediate_size": 64, "num_heads": 2, "in_channels": 3,
                 "patch_size": 16, "temporal_patch_size": 2, "spatial_merge_size": 2, "out_hidden_size": 64,
                 "num_position_embeddings": 16, "hidden_act": "gelu_pytorch_tanh"}


def main(out: Path) -> None:
    cls = transformers.Qwen3_5MoeVisionModel if hasattr(transformers, "Qwen3_5MoeVisionModel") else None
    config = transformers.Qwen3_5MoeConfig(vision_config=VISION_CONFIG)
    with torch.device("meta"):
        if cls is not None:
            model = cls._from_config(config.vision_config)
            prefix = "model.visual."
        else:
            model = transformers.Qwen3_5MoeForConditionalGeneration(config).model.visual
            prefix = "model.visual."
    tensors = {prefix + name: list(p.shape) for name, p in model.state_dict().items()}
    vision = {k: v for k, v in config.vision_config.to_dict().items() if k in VISION_CONFIG or k == "model_type"}
    record = {"what": "names and shapes of a tiny Qwen3.5-MoE vision tower (transformers' own declaration)",
              "transformers": transformers.__version__, "torch": torch.__version__,
              "vision_config": {**vision, **VISION_CONFIG}, "tensors": dict(sorted(tensors.items()))}
    out.parent.mkdir(parents=True, exist_ok=True)
    lines = [f"  {json.dumps(k)}: {json.dumps(v)}" for k, v in record.pop("tensors").items()]
    head = json.dumps(record, indent=1)[:-2]
    out.write_text(head + ',\n "tensors": {\n' + ",\n".join(lines) + "\n }\n}\n")
    print(f"wrote {out}: {len(tensors)} tensors")


if __name__ == "__main__":
    main(Path(sys.argv[1]) if len(sys.argv) > 1 else
         Path(__file__).parent.parent / "tests" / "fixtures" / "hf_layouts" / "vision_tensors.json")
