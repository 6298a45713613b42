"""The quantization flows the trained bench compares: quantplug's presets (with algorithms), and
the peers' flows on the same program and data.

Every flow returns the logits of the test batches; quantplug's reference presets also lower to
the shipped artifact (``model.onnx``) and run it in ONNX Runtime.
"""

from __future__ import annotations

import contextlib
import io
import warnings
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
import torch.nn.functional as F

import quantplug
from bench.trained.tasks import Task

#: every preset of both backends: (backend, options)
PRESETS: dict[str, tuple[str, dict[str, Any]]] = {
    **{
        f"ref {p}": ("reference", {"preset": p})
        for p in ("int8", "int8_per_tensor", "a16w8", "dynamic_int8", "weight_only_int8", "weight_only_int4")
    },
    **{
        f"htp {p}": ("qnn_htp", {"precision": p})
        for p in ("8a8w", "16a8w", "16a16w", "8a4w", "16a4w", "16a4w_block", "16a2w")
    },
}
HTP = {"soc_model": "SM8650"}
#: 4-bit configs that get every algorithm and the combinations, and their 8-bit-weight counterpart
FOUR_BIT = {
    "ref weight_only_int4": "ref weight_only_int8",
    "htp 16a4w": "htp 16a8w",
    "htp 16a4w_block": "htp 16a8w",
    "htp 8a4w": "htp 8a8w",
}

Spec = str | tuple[str, dict[str, Any]]
GPTQ_SCALE_SEARCH: Spec = ("gptq", {"scale_search": 20})
#: combinations tried for "best" beside each algorithm alone (a missing algorithm skips one)
COMBINATIONS: tuple[tuple[Spec, ...], ...] = (
    ("seq_mse", "adaround"),
    ("gptq", "bias_correction"),
    (GPTQ_SCALE_SEARCH,),
    ("smoothquant", GPTQ_SCALE_SEARCH),
    ("cle", GPTQ_SCALE_SEARCH, "bias_correction"),
)


def label(algorithms: Sequence[Spec]) -> str:
    def one(spec: Spec) -> str:
        if isinstance(spec, str):
            return spec
        return f"{spec[0]}({', '.join(f'{k}={v}' for k, v in spec[1].items())})"

    return "+".join(one(a) for a in algorithms) or "default"


@contextlib.contextmanager
def quiet() -> Iterator[None]:
    """Peers print and warn a lot; the bench's log is its own."""
    with warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()):
        warnings.simplefilter("ignore")
        yield


def quantplug_flow(
    task: Task,
    backend: str,
    options: dict[str, Any],
    algorithms: Sequence[Spec] = (),
    artifact: bool = False,
    held_out: str | Sequence[Any] | None = None,
    guard_loss: Callable[[list[torch.Tensor], tuple[Any, ...]], float] | None = None,
) -> dict[str, Any]:
    """prepare (with ``algorithms`` judged by the default guard, or ``Algorithms(...,
    held_out=held_out, guard_loss=guard_loss)``) / calibrate / convert; the test logits of the Q/DQ
    program and, with ``artifact``, of the lowered model in ONNX Runtime."""
    quantizer = quantplug.get_quantizer(backend, **{**(HTP if backend == "qnn_htp" else {}), **options})
    algs = (
        quantplug.Algorithms(
            list(algorithms), calibration=task.calibration, held_out=held_out, guard_loss=guard_loss
        )
        if algorithms
        else None
    )
    with quiet():
        prepared = quantplug.prepare(task.program, quantizer, algorithms=algs)
        with torch.no_grad():
            for batch in task.calibration:
                prepared(*batch)
        converted = quantplug.convert(prepared)
        with torch.no_grad():
            found: dict[str, Any] = {"program": [converted(*b) for b in task.test]}
        if artifact:
            lowered = quantplug.lower(converted, quantizer)
            found["artifact"] = [lowered.run(*b) for b in task.test]
    return found


def next_byte_loss(outputs: list[torch.Tensor], inputs: tuple[Any, ...]) -> float:
    """The language models' own loss for ``Algorithms(guard_loss=...)``: the next byte's
    cross-entropy within each window (no labels needed: the next input byte is the label)."""
    logits, tokens = outputs[0], inputs[0]
    return float(F.cross_entropy(logits[:, :-1].flatten(0, 1), tokens[:, 1:].flatten()))


def _pt2e(task: Task, quantizer: Any) -> list[torch.Tensor]:
    from torchao.quantization.pt2e.quantize_pt2e import convert_pt2e, prepare_pt2e

    with quiet():
        prepared = prepare_pt2e(task.program.module(), quantizer)
        with torch.no_grad():
            for batch in task.calibration:
                prepared(*batch)
        converted = convert_pt2e(prepared)
        with torch.no_grad():
            return [converted(*b) for b in task.test]


def executorch_qnn(precision: str, per_channel_linear: bool = False) -> Callable[[Task], list[torch.Tensor]]:
    """ExecuTorch 1.5.1's QnnQuantizer (its defaults: per-channel conv, per-tensor linear weights
    unless asked; 16a4w_block: every linear whose inputs divide into blocks of 64 per block)."""

    def run(task: Task) -> list[torch.Tensor]:
        from executorch.backends.qualcomm.quantizer.quantizer import QnnQuantizer, QuantDtype
        from executorch.backends.qualcomm.serialization.qc_schema import QcomChipset

        with quiet():
            quantizer = QnnQuantizer(soc_model=QcomChipset.SM8650)
            quantizer.set_default_quant_config(
                getattr(QuantDtype, f"use_{precision}"),
                is_conv_per_channel=True,
                is_linear_per_channel=per_channel_linear or precision == "16a4w_block",
            )
            if precision == "16a4w_block":
                blocks = {
                    n.name: (1, 64)
                    for n in task.program.module().graph.nodes
                    if n.op == "call_function"
                    and n.target in (torch.ops.aten.linear.default, torch.ops.aten.conv2d.default)
                    and _in_features(n) % 64 == 0
                }
                quantizer.set_block_size_map(blocks)
        return _pt2e(task, quantizer)

    return run


def _in_features(node: torch.fx.Node) -> int:
    weight = node.args[1]
    value = getattr(weight, "meta", {}).get("val")
    return int(value.shape[1]) if value is not None and value.dim() >= 2 else 0


def xnnpack_int8(task: Task) -> list[torch.Tensor]:
    """ExecuTorch's XNNPACKQuantizer, static int8 with per-channel weights (through torchao's PT2E)."""
    from executorch.backends.xnnpack.quantizer.xnnpack_quantizer import (
        XNNPACKQuantizer,
        get_symmetric_quantization_config,
    )

    with quiet():
        quantizer = XNNPACKQuantizer().set_global(get_symmetric_quantization_config(is_per_channel=True))
    return _pt2e(task, quantizer)


def torchao_int4(task: Task) -> list[torch.Tensor]:
    """torchao 0.18's int4 weight-only quantization, symmetric, groups of 32 (``quantize_``'s
    default filter: linear layers only, embedding tables float), on a copy of the float model."""
    import copy

    from torchao.quantization import IntxWeightOnlyConfig, quantize_
    from torchao.quantization.granularity import PerGroup

    model = copy.deepcopy(task.model)
    with quiet():
        quantize_(model, IntxWeightOnlyConfig(weight_dtype=torch.int4, granularity=PerGroup(32)))
        with torch.no_grad():
            return [model(*b) for b in task.test]


#: peer flow name -> (the quantplug config it sits beside, the flow)
PEERS: dict[str, tuple[str, Callable[[Task], list[torch.Tensor]]]] = {
    "ExecuTorch QnnQuantizer 8a8w": ("htp 8a8w", executorch_qnn("8a8w")),
    "ExecuTorch QnnQuantizer 16a8w": ("htp 16a8w", executorch_qnn("16a8w")),
    "ExecuTorch QnnQuantizer 8a4w": ("htp 8a4w", executorch_qnn("8a4w")),
    "ExecuTorch QnnQuantizer 16a4w": ("htp 16a4w", executorch_qnn("16a4w")),
    "ExecuTorch QnnQuantizer 16a4w per-channel linear": ("htp 16a4w", executorch_qnn("16a4w", True)),
    "ExecuTorch QnnQuantizer 16a4w_block": ("htp 16a4w_block", executorch_qnn("16a4w_block")),
    "ExecuTorch XNNPACKQuantizer int8": ("ref int8", xnnpack_int8),
    "torchao int4 weight-only (group 32)": ("ref weight_only_int4", torchao_int4),
}
