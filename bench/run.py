"""quantplug vs torchao 0.18 PT2E: prepare, convert, calibration and forward, side by side.

Every model is exported once. Each repeat then runs, for each flow and with a fresh quantizer:
prepare (from the ExportedProgram), calibration forwards, convert, forwards of the converted
program. Flows:

* ``torchao``   : ``prepare_pt2e(ep.module(), X86InductorQuantizer)`` / ``convert_pt2e``
                  (``ep.module()`` is inside the prepare time: quantplug.prepare(ep) makes the same
                  copy internally)
* ``quantplug`` : ``quantplug.prepare(ep, X86InductorQuantizer)`` / ``quantplug.convert`` (the very
                  same annotations: torchao's quantizer annotates the graph)
* ``reference`` : ``quantplug.prepare(ep, quantplug.get_quantizer("reference"))`` / convert
* ``qnn_htp``   : ``quantplug.prepare(ep, quantplug.get_quantizer("qnn_htp", precision="16a8w",
                  **EXECUTORCH_DEFAULTS))`` / convert (quantplug's own Qualcomm HTP rules, with
                  ExecuTorch's moving-average activation observer)
* ``executorch``: ``prepare_pt2e(ep.module(), QnnQuantizer)`` / ``convert_pt2e`` with ExecuTorch
                  1.5.1's QnnQuantizer configured like ``qnn_htp`` (use_16a8w, per-channel conv
                  weights, per-tensor linear weights, SM8750)

Stage times are the minimum over repeats. Memory (peak RSS growth and tracemalloc peak of prepare
and of convert) is measured in a separate, untimed pass.
"""

from __future__ import annotations

import argparse
import cProfile
import datetime as _dt
import gc
import io
import json
import logging
import os
import platform
import pstats
import statistics
import sys
import time
import tracemalloc
import warnings
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from _quantplug.observers import kernels
from bench.models import build

HERE = Path(__file__).resolve().parent
DEFAULT_OUT = HERE / "results"

FLOWS = ("torchao", "quantplug", "reference", "qnn_htp", "executorch")


# ----------------------------------------------------------------------------- flows


def _x86_quantizer() -> Any:
    from torchao.quantization.pt2e.quantizer.x86_inductor_quantizer import (
        X86InductorQuantizer,
        get_default_x86_inductor_quantization_config,
    )

    return X86InductorQuantizer().set_global(get_default_x86_inductor_quantization_config())


def _clear_torchao_device_caches() -> None:
    """torchao/torch.ao cache the device per module with functools.cache, keeping every model alive.

    Clearing between runs (outside any timed region) stops that leak from inflating later
    memory readings; it does not change what torchao computes.
    """
    try:
        import torchao.utils as ao_utils

        ao_utils._assert_and_get_unique_device.cache_clear()
    except Exception:
        pass
    try:
        from torch.ao.quantization.fx import utils as fx_utils

        fx_utils.assert_and_get_unique_device.cache_clear()
    except Exception:
        pass


@dataclass
class Flow:
    name: str
    make_quantizer: Callable[[], Any]
    prepare: Callable[[torch.export.ExportedProgram, Any], Any]
    convert: Callable[[Any], Any]


def make_flows(names: tuple[str, ...]) -> list[Flow]:
    import quantplug

    flows = []
    if "torchao" in names:
        from torchao.quantization.pt2e.quantize_pt2e import convert_pt2e, prepare_pt2e

        flows.append(
            Flow("torchao", _x86_quantizer, lambda ep, q: prepare_pt2e(ep.module(), q), convert_pt2e)
        )
    if "quantplug" in names:
        flows.append(Flow("quantplug", _x86_quantizer, quantplug.prepare, quantplug.convert))
    if "reference" in names:
        flows.append(
            Flow(
                "reference",
                lambda: quantplug.get_quantizer("reference"),
                quantplug.prepare,
                quantplug.convert,
            )
        )
    if "qnn_htp" in names:
        quantplug.get_quantizer("qnn_htp", precision="16a8w")  # raises now if the plugin is missing
        from quantplug_qnn_htp import EXECUTORCH_DEFAULTS

        flows.append(
            Flow(
                "qnn_htp",
                lambda: quantplug.get_quantizer("qnn_htp", precision="16a8w", **EXECUTORCH_DEFAULTS),
                quantplug.prepare,
                quantplug.convert,
            )
        )
    if "executorch" in names:
        from torchao.quantization.pt2e.quantize_pt2e import convert_pt2e, prepare_pt2e

        flows.append(
            Flow(
                "executorch", _executorch_quantizer, lambda ep, q: prepare_pt2e(ep.module(), q), convert_pt2e
            )
        )
    return flows


def _executorch_quantizer() -> Any:
    """ExecuTorch 1.5.1's QnnQuantizer with the settings of ``qnn_htp``'s 16a8w defaults."""
    os.environ.setdefault("QNN_SDK_ROOT", "")  # or ExecuTorch tries to fetch an SDK on import
    logging.getLogger().setLevel(logging.ERROR)  # its per-node "could not resolve quant range" notes
    from executorch.backends.qualcomm.quantizer.quantizer import QnnQuantizer, QuantDtype
    from executorch.backends.qualcomm.serialization.qc_schema import QcomChipset

    quantizer = QnnQuantizer(soc_model=QcomChipset.SM8750)
    quantizer.set_default_quant_config(
        QuantDtype.use_16a8w, is_conv_per_channel=True, is_linear_per_channel=False
    )
    return quantizer


# ----------------------------------------------------------------------------- measuring


def _now() -> float:
    return time.perf_counter()


def _timed(fn: Callable[[], Any]) -> tuple[Any, float]:
    t0 = _now()
    out = fn()
    return out, _now() - t0


def _forward_time(module: Any, batch: tuple[Any, ...], reps: int) -> tuple[float, Any]:
    best, out = float("inf"), None
    with torch.no_grad():
        for _ in range(reps):
            out, t = _timed(lambda: module(*batch))
            best = min(best, t)
    return best, out


def _rss_kib(field_name: str) -> int | None:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field_name + ":"):
                    return int(line.split()[1])
    except OSError:
        return None
    return None


def _malloc_trim() -> None:
    """Hand freed heap back to the OS first, so RSS growth reflects new allocations (glibc only)."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except Exception:
        pass


def _reset_peak_rss() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


class PeakMemory:
    """Peak RSS growth (Linux VmHWM after resetting it) and tracemalloc peak of a block."""

    def __enter__(self) -> PeakMemory:
        gc.collect()
        _malloc_trim()
        self.rss_ok = _reset_peak_rss()
        self.rss0 = _rss_kib("VmRSS")
        tracemalloc.reset_peak()
        self.tm0 = tracemalloc.get_traced_memory()[0]
        return self

    def __exit__(self, *exc: Any) -> None:
        self.tm_peak_mb = (tracemalloc.get_traced_memory()[1] - self.tm0) / 2**20
        hwm = _rss_kib("VmHWM")
        self.rss_peak_mb = (hwm - self.rss0) / 1024 if self.rss_ok and hwm and self.rss0 else None


@dataclass
class FlowResult:
    prepare_s: list[float] = field(default_factory=list)
    convert_s: list[float] = field(default_factory=list)
    calib_s: list[float] = field(default_factory=list)  # the first batch of each repeat
    calib_later_s: list[float] = field(default_factory=list)  # batches after the first of a repeat
    calib_steady_s: list[float] = field(default_factory=list)  # the first batch fed again at the end
    # quantplug only: the first batch again, with the native kernels off (the pure-torch code path)
    calib_torch_path_s: list[float] = field(default_factory=list)
    qfwd_s: list[float] = field(default_factory=list)
    mem: dict[str, float | None] = field(default_factory=dict)
    prepared_nodes: int = 0
    converted_nodes: int = 0
    q_nodes: int = 0
    dq_nodes: int = 0
    output: Any = None

    def best(self, attr: str) -> float:
        values = getattr(self, attr)
        return min(values) if values else float("nan")

    def median(self, attr: str) -> float:
        values = getattr(self, attr)
        return statistics.median(values) if values else float("nan")


@dataclass
class ModelResult:
    name: str
    nodes: int
    export_s: float
    float_fwd_s: float
    float_first_s: float = float("nan")  # first forward of a freshly built ep.module()
    module_s: float = float("nan")  # ep.module() alone: the unlifted copy both flows start from
    repeats: int = 0
    flows: dict[str, FlowResult] = field(default_factory=dict)
    max_abs_diff_ao_qp: float | None = None
    max_abs_diff_et_qnn: float | None = None


def _count_qdq(gm: Any) -> tuple[int, int]:
    q = dq = 0
    for n in gm.graph.nodes:
        if n.op == "call_function":
            name = str(n.target)
            if name.startswith("quantized_decomposed.quantize_"):
                q += 1
            elif name.startswith("quantized_decomposed.dequantize_"):
                dq += 1
    return q, dq


def run_flow_once(
    flow: Flow, ep: Any, batch: Callable[[int], tuple[Any, ...]], res: FlowResult, args: Any
) -> Any:
    quantizer = flow.make_quantizer()  # fresh each time, outside the timed region
    gc.collect()
    prepared, t = _timed(lambda: flow.prepare(ep, quantizer))
    res.prepare_s.append(t)
    res.prepared_nodes = len(prepared.graph.nodes)
    gc.collect()  # a full collection owed to prepare's garbage would otherwise land in a batch
    with torch.no_grad():
        for i in range(args.calib_batches):
            inputs = batch(10 + i)
            t0 = _now()
            prepared(*inputs)
            (res.calib_later_s if i else res.calib_s).append(_now() - t0)
        # the first batch again: no range grows, as in most batches of a long calibration
        res.calib_steady_s.append(_timed(lambda: prepared(*batch(10)))[1])
    gc.collect()
    converted, t = _timed(lambda: flow.convert(prepared))
    res.convert_s.append(t)
    res.converted_nodes = len(converted.graph.nodes)
    res.q_nodes, res.dq_nodes = _count_qdq(converted)
    t, out = _forward_time(converted, batch(99), args.fwd_reps)
    res.qfwd_s.append(t)
    res.output = out
    if flow.name in ("torchao", "executorch"):
        _clear_torchao_device_caches()
    return out


def _float_first_call(ep: Any, batch: Callable[[int], tuple[Any, ...]], first_s: list[float]) -> float:
    """Time ``ep.module()`` (returned) and append the time of the fresh module's first forward."""
    module, t = _timed(ep.module)
    gc.collect()
    with torch.no_grad():
        first_s.append(_timed(lambda: module(*batch(10)))[1])
    return t


def _first_batch(flow: Flow, ep: Any, batch: Callable[[int], tuple[Any, ...]]) -> float:
    """The first calibration batch of a freshly prepared module, in seconds."""
    prepared = flow.prepare(ep, flow.make_quantizer())
    gc.collect()
    with torch.no_grad():
        t = _timed(lambda: prepared(*batch(10)))[1]
    if flow.name in ("torchao", "executorch"):
        _clear_torchao_device_caches()
    return t


def measure_memory(flow: Flow, ep: Any, batch: Callable[[int], tuple[Any, ...]], res: FlowResult) -> None:
    quantizer = flow.make_quantizer()
    tracemalloc.start()
    try:
        with PeakMemory() as m_prep:
            prepared = flow.prepare(ep, quantizer)
        with torch.no_grad():
            prepared(*batch(10))
        with PeakMemory() as m_conv:
            converted = flow.convert(prepared)
    finally:
        tracemalloc.stop()
    res.mem = {
        "prepare_rss_mb": m_prep.rss_peak_mb,
        "convert_rss_mb": m_conv.rss_peak_mb,
        "prepare_tracemalloc_mb": m_prep.tm_peak_mb,
        "convert_tracemalloc_mb": m_conv.tm_peak_mb,
    }
    del prepared, converted
    if flow.name in ("torchao", "executorch"):
        _clear_torchao_device_caches()
    gc.collect()


def bench_model(name: str, flows: list[Flow], args: Any, log: Callable[[str], None]) -> ModelResult:
    model, batch = build(name)
    ep, export_s = _timed(lambda: torch.export.export(model, batch(0)))
    float_fwd_s, _ = _forward_time(ep.module(), batch(1), args.fwd_reps)
    result = ModelResult(name, len(ep.graph.nodes), export_s, float_fwd_s)
    module_s, first_s = [], []
    for _ in range(3):  # fresh modules: ep.module() time, then the module's first forward
        module_s.append(_float_first_call(ep, batch, first_s))
    result.module_s = min(module_s)
    result.flows = {f.name: FlowResult() for f in flows}
    log(
        f"{name}: {result.nodes} exported nodes, export {export_s:.2f}s, float fwd {1e3 * float_fwd_s:.1f} ms"
    )
    started = _now()
    for rep in range(args.repeats):
        for flow in flows:  # interleaved, so background load hits all flows alike
            run_flow_once(flow, ep, batch, result.flows[flow.name], args)
        result.repeats = rep + 1
        spent = _now() - started
        log(
            f"  repeat {rep + 1}: "
            + ", ".join(
                f"{f.name} p+c {result.flows[f.name].prepare_s[-1] + result.flows[f.name].convert_s[-1]:.3f}s"
                for f in flows
            )
            + f" ({spent:.0f}s so far)"
        )
        if spent > args.model_budget_s and rep + 1 < args.repeats:
            log(f"  stopping after {rep + 1} repeat(s): over the {args.model_budget_s:.0f}s model budget")
            break
    # first calibration batches again, alternating with float first calls: on this kind of
    # machine the speed drifts by 10% over minutes, and the 1.3x target is a ratio of the two;
    # every flow gets the same rounds, so that each ratio is a minimum over as many samples
    for _ in range(args.calib_rounds):
        _float_first_call(ep, batch, first_s)
        for flow in flows:
            res = result.flows[flow.name]
            res.calib_s.append(_first_batch(flow, ep, batch))
            if flow.name == "quantplug" and kernels.enabled():
                with kernels.disabled():
                    res.calib_torch_path_s.append(_first_batch(flow, ep, batch))
    result.float_first_s = min(first_s)
    if "torchao" in result.flows and "quantplug" in result.flows:
        a, b = result.flows["torchao"].output, result.flows["quantplug"].output
        result.max_abs_diff_ao_qp = float((a - b).abs().max())
    if "executorch" in result.flows and "qnn_htp" in result.flows:
        a, b = result.flows["executorch"].output, result.flows["qnn_htp"].output
        result.max_abs_diff_et_qnn = float((a - b).abs().max())
    if not args.no_memory:
        for flow in flows:
            measure_memory(flow, ep, batch, result.flows[flow.name])
    for fr in result.flows.values():
        fr.output = None
    return result


# ----------------------------------------------------------------------------- reporting


def machine_description() -> dict[str, Any]:
    cpu = platform.processor() or "unknown"
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    versions: dict[str, str] = {"python": platform.python_version(), "torch": torch.__version__}
    for mod in ("torchao", "executorch", "quantplug", "quantplug_reference", "quantplug_qnn_htp"):
        try:
            from importlib.metadata import version

            versions[mod] = version(mod.replace("_", "-"))
        except Exception:
            versions[mod] = "not installed"
    mem_total = None
    try:
        with open("/proc/meminfo") as f:
            mem_total = f.readline().split()[1]
    except OSError:
        pass
    return {
        "date": _dt.datetime.now().isoformat(timespec="seconds"),
        "platform": platform.platform(),
        "nproc": os.cpu_count(),
        "cpu_model": cpu,
        "mem_total_gib": round(int(mem_total) / 2**20, 1) if mem_total else None,
        "torch_threads": torch.get_num_threads(),
        "quantplug_native_kernels": kernels.enabled(),
        "load_average_start": os.getloadavg(),
        "versions": versions,
    }


def _f(x: float | None, digits: int = 3) -> str:
    if x is None or x != x:
        return "–"
    return f"{x:.{digits}f}"


def _ratio(a: float | None, b: float | None, digits: int = 1) -> str:
    if a is None or b is None or a != a or b != b or b == 0:
        return "–"
    return f"{a / b:.{digits}f}×"


def _cal(a: float | None, b: float | None) -> str:
    """A calibration ratio: two decimals, the target (1.3x) is close."""
    return _ratio(a, b, 2)


def _row(*cells: Any) -> str:
    return "| " + " | ".join(str(c) for c in cells) + " |"


def _header(*names: str) -> list[str]:
    return [_row(*names), "|---|" + "---:|" * (len(names) - 1)]


def _ms(x: float | None) -> str:
    return _f(None if x is None else 1e3 * x, 1)


def render_markdown(results: list[ModelResult], machine: dict[str, Any], args: Any) -> str:
    has = {name: all(name in r.flows for r in results) for name in FLOWS}
    v = machine["versions"]
    load0 = ", ".join(f"{x:.2f}" for x in machine["load_average_start"])
    load1 = ", ".join(f"{x:.2f}" for x in machine.get("load_average_end", ()))
    lines = [
        "# quantplug vs torchao 0.18 PT2E — X86InductorQuantizer (default config)",
        "",
        f"Machine: {machine['nproc']} CPUs, {machine['cpu_model']}, {machine['mem_total_gib']} GiB; "
        f"torch {v['torch']}, torchao {v['torchao']}, quantplug {v['quantplug']}, Python {v['python']}; "
        f"torch threads {machine['torch_threads']}; quantplug native kernels "
        f"{'on' if machine.get('quantplug_native_kernels') else 'off'}; load average at start {load0}, "
        f"at end {load1}. {machine['date']}.",
        "",
        f"Stage times: minimum over repeats (column `reps`); forwards: minimum of {args.fwd_reps}. "
        "`nodes` = nodes of the exported graph; ms/node = (prepare + convert) / nodes. torchao's "
        "prepare includes `ep.module()`, the GraphModule prepare_pt2e needs (quantplug.prepare(ep) "
        "builds its own working copy from the ExportedProgram, inside its prepare time; the "
        "`ep.module()` column times ep.module() alone). × = torchao / quantplug. Calibration: each "
        f"repeat feeds {args.calib_batches} batches to a freshly prepared model; `calib` is its first "
        f"batch (minimum over the repeats and {args.calib_rounds} more rounds that alternate a float "
        "first call with a first batch of every flow on freshly prepared modules), "
        "`later` the median of the batches after the first (observers whose range grows re-bin "
        "their histograms there; early batches grow most ranges).",
        "",
    ]
    if has["torchao"] and has["quantplug"]:
        lines += ["## prepare + convert (seconds)", ""]
        lines += _header(
            "model",
            "nodes",
            "reps",
            "ep.module()",
            "torchao prepare",
            "quantplug prepare",
            "×",
            "torchao convert",
            "quantplug convert",
            "×",
            "torchao p+c",
            "quantplug p+c",
            "×",
            "torchao ms/node",
            "quantplug ms/node",
        )
        for r in results:
            a, q = r.flows["torchao"], r.flows["quantplug"]
            ap, qp_ = a.best("prepare_s"), q.best("prepare_s")
            ac, qc = a.best("convert_s"), q.best("convert_s")
            lines.append(
                _row(
                    r.name,
                    r.nodes,
                    r.repeats,
                    _f(r.module_s),
                    _f(ap),
                    _f(qp_),
                    _ratio(ap, qp_),
                    _f(ac),
                    _f(qc),
                    _ratio(ac, qc),
                    _f(ap + ac),
                    _f(qp_ + qc),
                    _ratio(ap + ac, qp_ + qc),
                    _f(1e3 * (ap + ac) / r.nodes),
                    _f(1e3 * (qp_ + qc) / r.nodes),
                )
            )
        lines += ["", "## calibration and forward (milliseconds)", ""]
        lines += [
            "`float fwd`: the float module, warm (minimum of repeated calls); `float 1st`: the first "
            "call of a freshly built `ep.module()` (its generated code runs for the first time, as "
            "a freshly prepared module's does in its first calibration batch; minimum over 3 calls "
            "and one per calibration round). `calib` (the first "
            "batch) is compared with both; `later` (median of the following batches) and `steady` "
            "(the first batch fed again after them: no range grows, as in most batches of a long "
            "calibration; minimum over repeats) with the warm forward. quantplug's histogram "
            "observers run native kernels (built with the package "
            "where a C compiler is available); `torch path` is its first batch with them off "
            "(`QUANTPLUG_NATIVE_KERNELS=0`), on freshly prepared modules in the same rounds.",
            "",
        ]
        lines += _header(
            "model",
            "float fwd",
            "float 1st",
            "torchao calib",
            "×float 1st",
            "×float",
            "quantplug calib",
            "×float 1st",
            "×float",
            "quantplug calib, torch path",
            "×float 1st",
            "torchao later",
            "×float",
            "quantplug later",
            "×float",
            "torchao steady",
            "×float",
            "quantplug steady",
            "×float",
            "torchao Q/DQ fwd",
            "quantplug Q/DQ fwd",
            "torchao Q/DQ",
            "quantplug Q/DQ",
            "max abs diff of outputs",
        )
        for r in results:
            a, q = r.flows["torchao"], r.flows["quantplug"]
            fl, ff, ac_, qc_ = r.float_fwd_s, r.float_first_s, a.best("calib_s"), q.best("calib_s")
            diff = "–" if r.max_abs_diff_ao_qp is None else f"{r.max_abs_diff_ao_qp:.2e}"
            lines.append(
                _row(
                    r.name,
                    _ms(fl),
                    _ms(ff),
                    _ms(ac_),
                    _cal(ac_, ff),
                    _cal(ac_, fl),
                    _ms(qc_),
                    _cal(qc_, ff),
                    _cal(qc_, fl),
                    _ms(q.best("calib_torch_path_s")),
                    _cal(q.best("calib_torch_path_s"), ff),
                    _ms(a.median("calib_later_s")),
                    _cal(a.median("calib_later_s"), fl),
                    _ms(q.median("calib_later_s")),
                    _cal(q.median("calib_later_s"), fl),
                    _ms(a.best("calib_steady_s")),
                    _cal(a.best("calib_steady_s"), fl),
                    _ms(q.best("calib_steady_s")),
                    _cal(q.best("calib_steady_s"), fl),
                    _ms(a.best("qfwd_s")),
                    _ms(q.best("qfwd_s")),
                    f"{a.q_nodes}/{a.dq_nodes}",
                    f"{q.q_nodes}/{q.dq_nodes}",
                    diff,
                )
            )
        if not args.no_memory:
            lines += ["", "## memory of prepare / convert (MiB; peak RSS growth, tracemalloc peak)", ""]
            lines += _header(
                "model",
                "torchao prepare RSS",
                "quantplug prepare RSS",
                "torchao convert RSS",
                "quantplug convert RSS",
                "torchao prepare tracemalloc",
                "quantplug prepare tracemalloc",
                "torchao convert tracemalloc",
                "quantplug convert tracemalloc",
            )
            for r in results:
                am, qm = r.flows["torchao"].mem, r.flows["quantplug"].mem
                cells: list[Any] = [r.name]
                for key, digits in (("prepare_rss_mb", 1), ("convert_rss_mb", 1)):
                    cells += [_f(am.get(key), digits), _f(qm.get(key), digits)]
                for key in ("prepare_tracemalloc_mb", "convert_tracemalloc_mb"):
                    cells += [_f(am.get(key), 2), _f(qm.get(key), 2)]
                lines.append(_row(*cells))
            lines += [
                "",
                "RSS growth is coarse (freed pages are reused, tensor storage is counted, Python objects "
                "too); tracemalloc counts Python allocations only (not tensor storage). Memory is "
                "measured in a separate pass, with tracemalloc on.",
            ]
    if has["reference"]:
        lines += [
            "",
            "## quantplug `reference` backend (its own annotations, int8; seconds unless noted)",
            "",
        ]
        lines += _header(
            "model",
            "nodes",
            "prepare",
            "convert",
            "p+c",
            "ms/node",
            "calib ms",
            "×float 1st",
            "Q/DQ fwd ms",
            "Q/DQ",
            "prepare RSS MiB",
            "convert RSS MiB",
        )
        for r in results:
            f = r.flows["reference"]
            p, c, cal = f.best("prepare_s"), f.best("convert_s"), f.best("calib_s")
            lines.append(
                _row(
                    r.name,
                    r.nodes,
                    _f(p),
                    _f(c),
                    _f(p + c),
                    _f(1e3 * (p + c) / r.nodes),
                    _ms(cal),
                    _cal(cal, r.float_first_s),
                    _ms(f.best("qfwd_s")),
                    f"{f.q_nodes}/{f.dq_nodes}",
                    _f(f.mem.get("prepare_rss_mb"), 1),
                    _f(f.mem.get("convert_rss_mb"), 1),
                )
            )
    if has["qnn_htp"] and has["executorch"]:
        lines += _qnn_section(results, args)
    return "\n".join(lines) + "\n"


def _qnn_section(results: list[ModelResult], args: Any) -> list[str]:
    lines = [
        "",
        "## `qnn_htp` (16a8w) vs ExecuTorch 1.5.1 QnnQuantizer (use_16a8w) "
        "through torchao prepare_pt2e/convert_pt2e",
        "",
        "Same settings on both sides: 16-bit activations (moving-average min/max), 8-bit weights, "
        "per-channel conv and per-tensor linear weights, SM8750. ExecuTorch's prepare includes "
        "`ep.module()`. × = ExecuTorch / qnn_htp. The outputs differ where qnn_htp deliberately "
        "differs (derived int32 biases, concat ranges; see plugins/qnn_htp/README.md).",
        "",
    ]
    lines += _header(
        "model",
        "nodes",
        "ExecuTorch prepare",
        "qnn_htp prepare",
        "ExecuTorch convert",
        "qnn_htp convert",
        "ExecuTorch p+c",
        "qnn_htp p+c",
        "×",
        "ExecuTorch calib ×float 1st",
        "qnn_htp calib ×float 1st",
        "ExecuTorch Q/DQ fwd ms",
        "qnn_htp Q/DQ fwd ms",
        "ExecuTorch Q/DQ",
        "qnn_htp Q/DQ",
        "max abs diff",
        "ExecuTorch p/c RSS MiB",
        "qnn_htp p/c RSS MiB",
    )
    for r in results:
        e, q = r.flows["executorch"], r.flows["qnn_htp"]
        ep_, qp_ = e.best("prepare_s"), q.best("prepare_s")
        ec, qc = e.best("convert_s"), q.best("convert_s")
        diff = "–" if r.max_abs_diff_et_qnn is None else f"{r.max_abs_diff_et_qnn:.2e}"
        lines.append(
            _row(
                r.name,
                r.nodes,
                _f(ep_),
                _f(qp_),
                _f(ec),
                _f(qc),
                _f(ep_ + ec),
                _f(qp_ + qc),
                _ratio(ep_ + ec, qp_ + qc),
                _cal(e.best("calib_s"), r.float_first_s),
                _cal(q.best("calib_s"), r.float_first_s),
                _ms(e.best("qfwd_s")),
                _ms(q.best("qfwd_s")),
                f"{e.q_nodes}/{e.dq_nodes}",
                f"{q.q_nodes}/{q.dq_nodes}",
                diff,
                f"{_f(e.mem.get('prepare_rss_mb'), 1)} / {_f(e.mem.get('convert_rss_mb'), 1)}",
                f"{_f(q.mem.get('prepare_rss_mb'), 1)} / {_f(q.mem.get('convert_rss_mb'), 1)}",
            )
        )
    return lines


def plot(results: list[ModelResult], path: Path, log: Callable[[str], None]) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except Exception as exc:
        log(f"matplotlib unavailable ({type(exc).__name__}); skipping the plot")
        return False
    fig, ax = plt.subplots(figsize=(7, 4.5))
    styles = {
        "torchao": ("tab:red", "o"),
        "quantplug": ("tab:blue", "s"),
        "reference": ("tab:green", "^"),
        "executorch": ("tab:orange", "D"),
        "qnn_htp": ("tab:purple", "v"),
    }
    for flow, (color, marker) in styles.items():
        dec = [r for r in results if r.name.startswith("decoder-") and flow in r.flows]
        dec.sort(key=lambda r: r.nodes)
        if dec:
            xs = [r.nodes for r in dec]
            ys = [
                1e3 * (r.flows[flow].best("prepare_s") + r.flows[flow].best("convert_s")) / r.nodes
                for r in dec
            ]
            ax.plot(xs, ys, color=color, marker=marker, label=f"{flow} (decoder)")
        other = [r for r in results if not r.name.startswith("decoder-") and flow in r.flows]
        for r in other:
            y = 1e3 * (r.flows[flow].best("prepare_s") + r.flows[flow].best("convert_s")) / r.nodes
            ax.scatter([r.nodes], [y], color=color, marker="x")
            if flow == "quantplug":
                ax.annotate(r.name, (r.nodes, y), fontsize=7, xytext=(3, -10), textcoords="offset points")
    ax.set_xscale("log")
    ax.set_xlabel("exported graph nodes")
    ax.set_ylabel("prepare + convert, ms per node")
    ax.set_title(
        "prepare + convert per node (x = ResNet; torchao/quantplug: X86 rules; executorch/qnn_htp: 16a8w)",
        fontsize=9,
    )
    ax.set_ylim(bottom=0)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


# ----------------------------------------------------------------------------- profiling


def profile_quantplug(n_blocks: int, out_dir: Path, log: Callable[[str], None], top: int = 40) -> Path:
    """cProfile quantplug prepare + convert (X86 annotations) on decoder-N; writes the report."""
    import quantplug

    model, batch = build(f"decoder-{n_blocks}")
    ep = torch.export.export(model, batch(0))
    # warm run, then the profiled one
    for profiled in (False, True):
        quantizer = _x86_quantizer()
        prof = cProfile.Profile() if profiled else None
        if prof:
            prof.enable()
        prepared = quantplug.prepare(ep, quantizer)
        if prof:
            prof.disable()
        with torch.no_grad():
            prepared(*batch(10))
        if prof:
            prof.enable()
        quantplug.convert(prepared)
        if prof:
            prof.disable()
    buf = io.StringIO()
    stats = pstats.Stats(prof, stream=buf).sort_stats("cumulative")
    buf.write(f"# cProfile of quantplug.prepare + quantplug.convert, decoder-{n_blocks}, X86 annotations\n")
    buf.write("\n## all functions, by cumulative time\n")
    stats.print_stats(top)
    buf.write("\n## quantplug functions only, by cumulative time\n")
    stats.print_stats(r"quantplug", top)
    path = out_dir / f"profile_quantplug_decoder-{n_blocks}.txt"
    path.write_text(buf.getvalue())
    log(f"profile written to {path}")
    return path


# ----------------------------------------------------------------------------- main


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench", description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", type=int, nargs="*", default=[2, 8, 32, 128], help="decoder block counts N")
    p.add_argument(
        "--resnets",
        nargs="*",
        default=["resnet18"],
        choices=["resnet18", "resnet34"],
        help="ResNet-like models",
    )
    p.add_argument("--flows", nargs="*", default=list(FLOWS), choices=list(FLOWS))
    p.add_argument("--repeats", type=int, default=3, help="repeats per model (stage time = min)")
    p.add_argument(
        "--model-budget-s",
        type=float,
        default=120.0,
        help="stop repeating a model once it has taken this long",
    )
    p.add_argument("--calib-batches", type=int, default=4, help="calibration batches per repeat")
    p.add_argument(
        "--calib-rounds",
        type=int,
        default=4,
        help="extra first calibration batches of every flow per model, alternating with float first calls",
    )
    p.add_argument("--fwd-reps", type=int, default=3)
    p.add_argument("--threads", type=int, default=1, help="torch.set_num_threads")
    p.add_argument("--no-memory", action="store_true", help="skip the memory pass")
    p.add_argument(
        "--profile",
        type=int,
        nargs="*",
        default=[],
        metavar="N",
        help="also cProfile quantplug prepare+convert (X86 annotations) on decoder-N, for each N",
    )
    p.add_argument("--out", type=Path, default=DEFAULT_OUT)
    return p.parse_args(argv)


def _warm_up(flows: list[Flow]) -> None:
    """First-call costs (lazy imports, op registration, codegen caches) paid outside the timings."""
    model, batch = build("decoder-1")
    ep = torch.export.export(model, batch(0))
    for flow in flows:
        prepared = flow.prepare(ep, flow.make_quantizer())
        with torch.no_grad():
            prepared(*batch(1))
        converted = flow.convert(prepared)
        with torch.no_grad():
            converted(*batch(2))
    _clear_torchao_device_caches()


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    warnings.filterwarnings("ignore")
    torch.set_num_threads(args.threads)
    out_dir: Path = args.out
    out_dir.mkdir(parents=True, exist_ok=True)

    def log(msg: str) -> None:
        print(msg, file=sys.stderr, flush=True)

    try:
        flows = make_flows(tuple(args.flows))
    except Exception as exc:
        log(
            f"cannot set up the flows {args.flows} ({type(exc).__name__}: {exc}); "
            "run `bash bench/setup.sh` first"
        )
        return 2
    machine = machine_description()
    log(f"machine: {machine['nproc']} CPUs, {machine['cpu_model']}, versions {machine['versions']}")
    _warm_up(flows)
    names = [f"decoder-{n}" for n in args.sizes] + list(args.resnets)
    results = []
    for name in names:
        results.append(bench_model(name, flows, args, log))
    machine["load_average_end"] = os.getloadavg()
    md = render_markdown(results, machine, args)
    print(md)
    (out_dir / "results.md").write_text(md)
    (out_dir / "machine.json").write_text(json.dumps(machine, indent=2) + "\n")
    raw = []
    for r in results:
        d = asdict(r)
        for fr in d["flows"].values():
            fr.pop("output", None)
        raw.append(d)
    arg_values = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}
    payload = {"machine": machine, "args": arg_values, "results": raw}
    (out_dir / "results.json").write_text(json.dumps(payload, indent=2) + "\n")
    if plot(results, out_dir / "prepare_convert_ms_per_node.png", log):
        log(f"plot written to {out_dir / 'prepare_convert_ms_per_node.png'}")
    for n_blocks in args.profile:
        profile_quantplug(n_blocks, out_dir, log)
    log(f"results written to {out_dir}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
