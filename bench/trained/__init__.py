"""Quantization judged on trained models by their task metrics (issue 45.4): ``python -m bench.trained``."""
