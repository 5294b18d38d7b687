"""Quantized checkpoint formats read as stored (issue 30): each format turns a quantized
linear's stored tensors into one `QuantizedTensor` (or its float expansion) under the layer's
"<prefix>.weight" ([N, K], as GGUF blocks arrive), so the quantized linear method,
tensor-parallel slicing and fused shards work unchanged.

    eight_bit.py            compressed-tensors int-quantized (W8A8 int8, W8A16) and
                            float-quantized (FP8), native FP8 (quant_method fp8)
    int4.py                 AWQ (GEMM layout), GPTQ, compressed-tensors pack-quantized (W4A16)
    compressed_tensors.py   which compressed-tensors scheme a config holds (dispatch)
"""
