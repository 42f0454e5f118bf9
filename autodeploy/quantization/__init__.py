"""Quantized checkpoints and online quantization: formats (``scheme``), the producers' configs
(``readers``), the number formats in plain torch (``numerics``), parameters and their load hooks
(``params``, ``graph``, ``loading``), and the weight source for dequantized MoE experts
(``source``). The ``quantize`` pass (``passes/quantize.py``) puts them to work."""
