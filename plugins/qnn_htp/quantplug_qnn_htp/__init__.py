"""quantplug backend for Qualcomm QNN HTP (entry point ``qnn_htp`` in ``quantplug.backends``).

Importing this package imports nothing heavy: the hooks live in ``quantplug_qnn_htp.plugin`` and
the annotation rules in ``quantplug_qnn_htp.rules.*_rules`` modules the core loads on demand.
"""

from collections.abc import Mapping
from types import MappingProxyType

__version__ = "0.1.0"

#: the options under which qnn_htp's encodings are ExecuTorch 1.5.1 QnnQuantizer's: its moving-average
#: activation observer without a range margin, LSTM/GRU/RNN ops left float (it has no rule for
#: them) and per-tensor linear weights at every precision (``set_default_quant_config``'s
#: ``is_linear_per_channel=False``). qnn_htp's defaults observe the calibrated extremes with a
#: margin at 16 bits, quantize recurrent layers and give 4-bit linear weights one scale per channel
#: (README, "Deliberate differences from ExecuTorch's QnnQuantizer").
EXECUTORCH_DEFAULTS: Mapping[str, object] = MappingProxyType(
    {
        "act_observer": "moving_average",
        "act_range_margin": 1.0,
        "unroll_recurrent": False,
        "per_channel_linear": False,
    }
)


def make_config(precision: str = "8a8w", **options):  # type: ignore[no-untyped-def]
    """A QNN HTP ``QuantizationConfig`` for per-module / per-node overrides (see ``configs.make_config``)."""
    from quantplug_qnn_htp.configs import make_config as _make

    return _make(precision, **options)


def set_block_size_map(quantizer, mapping):  # type: ignore[no-untyped-def]
    """Per-node LPBQ block sizes of a qnn_htp quantizer (see ``plugin.set_block_size_map``)."""
    from quantplug_qnn_htp.plugin import set_block_size_map as _set

    return _set(quantizer, mapping)
