"""Quantized checkpoint formats read as stored (issue 30): each format turns a quantized
linear's stored tensors into one `QuantizedTensor` under the layer's "<prefix>.weight"
([N, K], as GGUF blocks arrive), so the quantized linear method, tensor-parallel slicing and
fused shards work unchanged.

    int4.py                 AWQ (GEMM layout), GPTQ, compressed-tensors pack-quantized (W4A16)
    compressed_tensors.py   which compressed-tensors scheme a config holds (dispatch)
"""
