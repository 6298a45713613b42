"""PT2E's reference representation: quantized ops written as integer arithmetic.

``convert_pt2e(..., use_reference_representation=True)`` rewrites each ``dq -> op -> q``
pattern torchao knows (add, add-relu, conv2d, linear static and dynamic, max-pool, and the
quantize/dequantize ops alone) into the integer computation it stands for: int8 inputs, int32
accumulation through ``out_dtype``, requantization by multiply and clamp. Compilers that lower
integer programs (and tests of them) read exactly that form.

The form is torchao's definition, kept in torchao's ``reference_representation_rewrite``; a
copy here would drift from it. quantplug's converted program uses the same
``quantized_decomposed`` ops with the same arguments as ``convert_pt2e``'s (weights folded to
integers, literal per-tensor qparams), so torchao's rewrite applies to it unchanged. Without
torchao the option is refused by name.
"""

from __future__ import annotations

from torch.fx import GraphModule

from _quantplug.errors import ConversionError


def reference_representation(converted: GraphModule) -> GraphModule:
    """``converted`` (a new module from convert) with torchao's reference representation."""
    try:
        from torchao.quantization.pt2e.reference_representation_rewrite import (
            reference_representation_rewrite,
        )
    except ImportError as exc:
        raise ConversionError(
            "convert(use_reference_representation=True) writes PT2E's reference representation, "
            "which torchao defines; install torchao (pip install torchao) or convert without it"
        ) from exc
    meta = dict(converted.meta)
    result = reference_representation_rewrite(converted)
    result.meta.update(meta)
    return result
