"""prepare, convert and the graph helpers they share.

Importing torch's ``_decomposed`` module registers the standard ``quantized_decomposed`` Q/DQ
ops, which modules here look up when they are imported.
"""

import torch.ao.quantization.fx._decomposed  # noqa: F401
