"""Mixed precision: per-layer presets chosen from measured sensitivity to meet an SQNR floor or a size budget.

Works with any backend through its presets (``qnn_htp``: ``16a4w``, ``8a8w``, ``16a8w``...;
``reference``: ``int8``, ``a16w8``...): a *layer* is a leaf module that owns a conv/linear weight
(or an LSTM/GRU/RNN's weight matrices: one layer per module, its layers and directions together),
and a choice is ``{module name: preset}``, applied as the Quantizer's ``set_module_name``
overrides with that preset's config. The choice is plain JSON the user can read, edit and apply
again (:meth:`MixedPrecision.apply`).

The search (as AIMET's AMP does, measured rather than modelled):

1. Sensitivity, with the numeric debugger (:func:`quantplug.debug.compare`): the model's output
   SQNR with every layer at the cheapest preset except one layer raised to each other preset.
2. Greedy: starting from all-cheapest, repeatedly raise the layer whose next preset buys the most
   SQNR per added weight byte; every step is quantized and measured for real, which gives the
   accuracy-size trade-off curve.
3. The answer: the smallest measured point meeting ``target_sqnr_db``, or the most accurate within
   ``max_weight_bytes``.

Weight bytes are what the layers' weights take in the model shipped: each weight a preset
quantizes at that preset's bits, each weight no preset quantizes (``qnn_htp`` leaves an LSTM float;
``reference``'s weight-only presets leave convolutions float) at its own size, the same at every
point. Only layers with weights some preset quantizes are chosen for.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from _quantplug.annotation.spec_view import spec_range
from _quantplug.api import get_quantizer
from _quantplug.debug.compare import compare
from _quantplug.errors import NonFiniteError, OptionError, QuantplugError
from _quantplug.flow.convert import convert
from _quantplug.flow.prepare import prepare
from _quantplug.graph.attrs import fetch_attr
from _quantplug.graph.calls import Call
from _quantplug.graph.recurrent import RECURRENT_OPS
from _quantplug.graph.working_copy import working_copy
from _quantplug.meta import FOLDED_FROM, STATE_KEY
from _quantplug.report.plot import tradeoff_plot_png
from _quantplug.suggest import did_you_mean

LAYER_OPS = ("aten.linear.default", "aten.conv1d.default", "aten.conv2d.default", "aten.conv3d.default")
FORMAT = "quantplug-mixed-precision/1"


@dataclass(frozen=True)
class Layer:
    """A leaf module owning a weight, with its weight's element count."""

    module: str
    weight_elements: int


@dataclass(frozen=True)
class CurvePoint:
    weight_bytes: float
    sqnr_db: float
    choice: Mapping[str, str]


@dataclass
class MixedPrecision:
    """A per-layer preset choice for one backend, and the measured trade-off curve behind it."""

    backend: str
    options: dict[str, Any]
    preset_option: str
    default: str
    choice: dict[str, str]
    curve: list[CurvePoint] = field(default_factory=list)
    sensitivity: dict[str, dict[str, float]] = field(default_factory=dict)
    target: dict[str, float] = field(default_factory=dict)

    @property
    def overrides(self) -> dict[str, str]:
        """The layers whose preset differs from the default (what ``apply`` sets)."""
        return {m: p for m, p in sorted(self.choice.items()) if p != self.default}

    def quantizer(self) -> Any:
        """A quantizer of the default preset with the choice applied."""
        return self.apply(get_quantizer(self.backend, **{**self.options, self.preset_option: self.default}))

    def apply(self, quantizer: Any) -> Any:
        """``quantizer.set_module_name(layer, config of its preset)`` for every override."""
        configs: dict[str, Any] = {}
        for module, preset in self.overrides.items():
            if preset not in configs:
                configs[preset] = get_quantizer(
                    self.backend, **{**self.options, self.preset_option: preset}
                ).global_config
            quantizer.set_module_name(module, configs[preset])
        return quantizer

    def to_dict(self) -> dict[str, Any]:
        return {
            "format": FORMAT,
            "backend": self.backend,
            "options": self.options,
            "preset_option": self.preset_option,
            "default": self.default,
            "overrides": self.overrides,
            "target": self.target,
            "chosen": next((i for i, p in enumerate(self.curve) if dict(p.choice) == self.choice), None),
            "curve": [
                {
                    "weight_bytes": p.weight_bytes,
                    "sqnr_db": _finite(p.sqnr_db),
                    "overrides": _diff(p.choice, self.default),
                }
                for p in self.curve
            ],
            "sensitivity": self.sensitivity,
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> MixedPrecision:
        if data.get("format") != FORMAT:
            raise QuantplugError(f"not a {FORMAT} document (format: {data.get('format')!r})")
        choice = {str(k): str(v) for k, v in dict(data.get("overrides", {})).items()}
        return cls(
            backend=str(data["backend"]),
            options=dict(data.get("options", {})),
            preset_option=str(data["preset_option"]),
            default=str(data["default"]),
            choice=choice,
            target=dict(data.get("target", {})),
        )

    def save(self, folder: str | Path) -> Path:
        """``mixed_precision.json`` (editable) and ``tradeoff.png`` (when matplotlib is installed)."""
        out = Path(folder)
        out.mkdir(parents=True, exist_ok=True)
        (out / "mixed_precision.json").write_text(json.dumps(self.to_dict(), indent=2) + "\n")
        png = self.plot_png()
        if png is not None:
            (out / "tradeoff.png").write_bytes(png)
        return out / "mixed_precision.json"

    @classmethod
    def load(cls, path: str | Path) -> MixedPrecision:
        return cls.from_dict(json.loads(Path(path).read_text()))

    def plot_png(self) -> bytes | None:
        """The accuracy-size trade-off curve (output SQNR against weight bytes), chosen point marked;
        None without matplotlib. The report draws the same figure from the same data."""
        return tradeoff_plot_png(self.to_dict())

    def check(self, program: torch.export.ExportedProgram) -> None:
        """Refuse a choice (a file the user edited, say) naming layers ``program`` does not have
        or presets its backend does not offer: applied as it is, the override would silently do
        nothing."""
        layers = [layer.module for layer in weighted_layers(program)]
        missing = [m for m in self.overrides if m not in layers]
        if missing:
            shown = ", ".join(f"{m!r}{did_you_mean(m, layers)}" for m in missing[:5])
            raise OptionError(
                f"mixed precision names {len(missing)} layer(s) the model does not have: {shown}; "
                f"its layers (modules owning a conv/linear/recurrent weight): {', '.join(layers[:20])}"
                + (" ..." if len(layers) > 20 else "")
            )
        known = [p.name for p in get_quantizer(self.backend, **self.options).info.presets]
        for preset in sorted({self.default, *self.overrides.values()}):
            if preset not in known:
                raise OptionError(
                    f"mixed precision uses preset {preset!r}{did_you_mean(preset, known)}, which backend "
                    f"{self.backend!r} does not offer; its presets: {', '.join(known)}"
                )


def _finite(value: float) -> float | None:
    return value if math.isfinite(value) else None


def _diff(choice: Mapping[str, str], default: str) -> dict[str, str]:
    return {m: p for m, p in sorted(choice.items()) if p != default}


def _layer_weights(program: torch.export.ExportedProgram) -> list[tuple[str, str, torch.Tensor]]:
    """``(module, weight target, weight)`` of every conv/linear weight and recurrent weight
    matrix owned by a leaf module, in graph order."""
    gm = working_copy(program)
    found: list[tuple[str, str, torch.Tensor]] = []
    for node in gm.graph.nodes:
        if node.op != "call_function":
            continue
        if str(node.target) in LAYER_OPS:
            weights = [node.args[1]]
        elif str(node.target) in RECURRENT_OPS and isinstance(node.args[2], (list, tuple)):
            weights = list(node.args[2])
        else:
            continue
        stack = node.meta.get("nn_module_stack") or {}
        module = str(list(stack.values())[-1][0]) if stack else ""
        for weight in weights:
            if not module or getattr(weight, "op", None) != "get_attr":
                continue
            value = fetch_attr(gm, str(weight.target))
            if isinstance(value, torch.Tensor) and value.dim() >= 2:
                found.append((module, str(weight.target), value))
    return found


def weighted_layers(
    program: torch.export.ExportedProgram, quantized: Collection[str] | None = None
) -> list[Layer]:
    """Leaf modules that own a conv/linear weight or a recurrent op's weight matrices (an
    ``nn.LSTM``: every layer's ``weight_ih``/``weight_hh``), in graph order; with ``quantized``
    (weight targets), only the weights in it count (:func:`quantized_weights`)."""
    return _layers(_layer_weights(program), quantized)


LayerWeights = Sequence[tuple[str, str, torch.Tensor]]  # (module, weight target, weight)


def _layers(weights: LayerWeights, quantized: Collection[str] | None) -> list[Layer]:
    layers: dict[str, int] = {}
    for module, target, value in weights:
        if quantized is None or target in quantized:
            layers[module] = layers.get(module, 0) + int(value.numel())
    return [Layer(m, n) for m, n in layers.items()]


def _float_bytes(weights: LayerWeights, quantized: Collection[str]) -> int:
    """The bytes of the layers' weights outside ``quantized``: shipped as they are, whatever the choice."""
    return sum(v.numel() * v.element_size() for _, target, v in weights if target not in quantized)


def quantized_weights(program: torch.export.ExportedProgram, quantizers: Sequence[Any]) -> set[str]:
    """The constants (get_attr targets) some of ``quantizers`` quantize in ``program``: the
    weights whose bits a preset sets. A layer whose weights no preset quantizes (``qnn_htp``
    leaves an LSTM float) has nothing to choose, and its float weights are no preset's bytes."""
    found: set[str] = set()
    for quantizer in quantizers:
        prepared = prepare(program, quantizer)
        state = prepared.meta[STATE_KEY]
        folded: dict[str, str] = prepared.meta.get(FOLDED_FROM, {})  # a conv's weight, batch norm folded in
        nodes = {n.name: n for n in prepared.graph.nodes}
        names = {producer for producer, _ in state.constant_edges} | set(state.constant_outputs)
        targets = {str(nodes[n].target) for n in names if n in nodes and nodes[n].op == "get_attr"}
        found |= {folded.get(t, t) for t in targets}
    return found


def _weight_bits(config: Any) -> int:
    spec = getattr(config, "weight", None)
    if spec is None:
        return 32
    qmin, qmax = spec_range(spec)
    return max(1, math.ceil(math.log2(qmax - qmin + 1)))


def search_mixed_precision(
    program: torch.export.ExportedProgram,
    backend: str,
    presets: Sequence[str],
    calibration: Sequence[Any],
    *,
    target_sqnr_db: float | None = None,
    max_weight_bytes: float | None = None,
    max_weight_growth: float | None = None,
    options: Mapping[str, Any] | None = None,
    compare_inputs: Sequence[Any] | None = None,
    progress: Callable[[str], None] | None = None,
) -> MixedPrecision:
    """Choose a preset per layer among ``presets`` to meet a target; see the module docstring.

    Args:
        program: the float program.
        backend: the backend name; ``presets`` are its preset names (at least two).
        calibration: batches for calibration (tuples of inputs, or single tensors).
        target_sqnr_db: the output SQNR floor (smallest model meeting it).
        max_weight_bytes: the weight-size budget (most accurate model within it).
        max_weight_growth: the budget as a fraction above the all-cheapest model's weight bytes
            (0.25: at most 25 % more).
        options: other backend options (the preset option is set per layer).
        compare_inputs: batches the SQNR is measured on (default: the calibration batches).

    Batches are what :class:`~_quantplug.graph.calls.Call` accepts: a tuple of positional inputs,
    a dict of keyword inputs, a Call, or a single tensor.
    """
    targets = [t for t in (target_sqnr_db, max_weight_bytes, max_weight_growth) if t is not None]
    if len(targets) != 1:
        raise OptionError(
            "give exactly one target: target_sqnr_db (an SQNR floor), max_weight_bytes (a budget) "
            "or max_weight_growth (a budget relative to the cheapest model)"
        )
    if max_weight_growth is not None and not 0 <= max_weight_growth < math.inf:
        raise OptionError(
            f"max_weight_growth must be a fraction >= 0 (0.25: 25 % more), got {max_weight_growth}"
        )
    if max_weight_bytes is not None and not 0 <= max_weight_bytes < math.inf:
        raise OptionError(f"max_weight_bytes must be a number of bytes >= 0, got {max_weight_bytes}")
    if target_sqnr_db is not None and not math.isfinite(target_sqnr_db):
        raise OptionError(f"target_sqnr_db must be a finite number of decibels, got {target_sqnr_db}")
    if len(set(presets)) < 2:
        raise OptionError(f"mixed precision needs at least two presets to choose from, got {list(presets)}")
    options = dict(options or {})
    probe = get_quantizer(backend, **options)
    preset_option = probe.info.preset_option
    if not preset_option:
        raise OptionError(
            f"backend {backend!r} declares no preset option; mixed precision chooses among presets"
        )
    if preset_option in options:  # it would be overridden layer by layer, silently
        raise OptionError(
            f"options set {preset_option}={options[preset_option]!r}, which mixed precision chooses "
            f"for each layer among {list(presets)}; leave it out of options"
        )
    known = [p.name for p in probe.info.presets]
    for preset in presets:
        if preset not in known:
            raise OptionError(
                f"backend {backend!r} has no preset {preset!r}{did_you_mean(preset, known)}; "
                f"its presets: {', '.join(known)}"
            )
    bits = {
        p: _weight_bits(get_quantizer(backend, **{**options, preset_option: p}).global_config)
        for p in presets
    }
    order = sorted(dict.fromkeys(presets), key=lambda p: (bits[p], list(presets).index(p)))
    quantizers = [get_quantizer(backend, **{**options, preset_option: p}) for p in order]
    quantized = quantized_weights(program, quantizers)
    weights = _layer_weights(program)  # one working copy for both
    layers = _layers(weights, quantized)
    fixed = _float_bytes(weights, quantized)
    if not layers:
        raise QuantplugError(
            "the program has no conv/linear/recurrent layer owned by a module whose weights "
            f"{backend} quantizes at {', '.join(order)}: nothing to choose a precision for"
        )
    batches = [Call.of(b) for b in calibration]
    measured = [Call.of(b) for b in (compare_inputs or calibration)]

    def size(choice: Mapping[str, str]) -> float:
        return fixed + sum(layer.weight_elements * bits[choice[layer.module]] / 8 for layer in layers)

    def measure(choice: Mapping[str, str]) -> float:
        result = MixedPrecision(backend, options, preset_option, order[0], dict(choice))
        quantizer = result.quantizer()
        prepared = prepare(program, quantizer)
        with torch.no_grad():
            for batch in batches:
                batch.run(prepared)
        quantized = convert(prepared)
        report = compare(program, quantized, measured)
        value = report.output_sqnr_db
        if value is not None and math.isnan(value):  # every choice would compare NaN with NaN
            raise NonFiniteError(
                "mixed precision measured the output SQNR as NaN: the float program's outputs on "
                f"the {'compare_inputs' if compare_inputs else 'calibration'} batches hold NaN "
                "(NaN in those inputs, or an overflow in the model); measure on finite data",
                reached="the output SQNR of mixed precision's search",
            )
        return float("inf") if value is None else float(value)

    base = {layer.module: order[0] for layer in layers}
    if max_weight_growth is not None:
        max_weight_bytes = size(base) * (1.0 + max_weight_growth)
    base_sqnr = measure(base)
    sensitivity: dict[str, dict[str, float]] = {}
    for layer in layers:
        sensitivity[layer.module] = {order[0]: base_sqnr}
        for preset in order[1:]:
            if progress is not None:
                progress(f"sensitivity {layer.module} @ {preset}")
            sensitivity[layer.module][preset] = measure({**base, layer.module: preset})

    choice = dict(base)
    curve = [CurvePoint(size(choice), base_sqnr, dict(choice))]
    while True:
        best: tuple[float, str, str] | None = None
        for layer in layers:
            level = order.index(choice[layer.module])
            if level + 1 >= len(order):
                continue
            nxt = order[level + 1]
            gain = _gain(sensitivity[layer.module][nxt]) - _gain(
                sensitivity[layer.module][choice[layer.module]]
            )
            cost = layer.weight_elements * (bits[nxt] - bits[choice[layer.module]]) / 8
            ratio = gain / max(cost, 1e-9)
            if best is None or ratio > best[0]:
                best = (ratio, layer.module, nxt)
        if best is None:
            break
        choice[best[1]] = best[2]
        if max_weight_bytes is not None and size(choice) > max_weight_bytes:
            break
        if progress is not None:
            progress(f"step {len(curve)}: {best[1]} -> {best[2]}")
        curve.append(CurvePoint(size(choice), measure(choice), dict(choice)))
        if target_sqnr_db is not None and curve[-1].sqnr_db >= target_sqnr_db:
            break
    if target_sqnr_db is not None:
        meeting = [p for p in curve if p.sqnr_db >= target_sqnr_db]
        chosen = (
            min(meeting, key=lambda p: p.weight_bytes) if meeting else max(curve, key=lambda p: p.sqnr_db)
        )
        target = {"sqnr_db": float(target_sqnr_db)}
    else:
        assert max_weight_bytes is not None
        within = [p for p in curve if p.weight_bytes <= max_weight_bytes] or [curve[0]]
        chosen = max(within, key=lambda p: p.sqnr_db)
        target = {"weight_bytes": float(max_weight_bytes)}
        if max_weight_growth is not None:
            target["weight_growth"] = float(max_weight_growth)
    return MixedPrecision(
        backend=backend,
        options=options,
        preset_option=preset_option,
        default=order[0],
        choice=dict(chosen.choice),
        curve=curve,
        sensitivity=sensitivity,
        target=target,
    )


def _gain(sqnr_db: float) -> float:
    """SQNR as a number the greedy can difference (an exact match counts as 200 dB)."""
    return sqnr_db if math.isfinite(sqnr_db) else 200.0
