"""Low-precision weights (issue 25): FP8 W8A8 (fp8.py), INT4 W4A16 with the AWQ and GPTQ checkpoint layouts
(int4.py), the QuantizedLinear module that holds either (linear.py) and the in-place swap of a model's linears
(apply.py); quality.py measures a quantized model against its float original."""
