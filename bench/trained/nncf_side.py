"""NNCF's INT4 weight compression on the trained models, for ``bench.trained``'s peer rows.

NNCF 3.4 must not share quantplug's venv (it would be free to move torch), so it runs in its own
and writes ``bench/results/trained_nncf.json``; ``python -m bench.trained`` shows its rows beside
``ref weight_only_int4`` (the same test batches, metrics from :func:`bench.trained.tasks.metrics`)::

    python3.11 -m venv /tmp/nncf-venv
    /tmp/nncf-venv/bin/pip install torch==2.13.0 && /tmp/nncf-venv/bin/pip install nncf==3.4.0
    /tmp/nncf-venv/bin/python -m bench.trained.nncf_side          # in the checkout's root

Flows, each on a copy of the float model, calibrated on the 8 calibration batches quantplug gets:
INT4 symmetric groups of 32 on every layer NNCF compresses (``all_layers=True``: the embedding
and the last layer too, as ``weight_only_int4`` does), data-free; and the same with NNCF's
data-aware scale estimation and AWQ (its best INT4 recipe for LLMs), where its torch backend
runs them on the model.
"""

from __future__ import annotations

import argparse
import copy
import json
import time
import warnings
from pathlib import Path
from typing import Any

import torch

from bench.trained.tasks import MODELS, Task, metrics, task

OUT = Path(__file__).resolve().parent.parent / "results" / "trained_nncf.json"

#: flow name -> compress_weights keywords beyond mode/group/ratio/all_layers
FLOWS: dict[str, dict[str, Any]] = {
    "NNCF INT4 sym (group 32, all layers)": {},
    "NNCF INT4 sym (group 32, all layers) + scale estimation + AWQ": {"scale_estimation": True, "awq": True},
}


def run_flow(t: Task, extra: dict[str, Any]) -> dict[str, Any]:
    import nncf

    model = copy.deepcopy(t.model).eval()
    dataset = nncf.Dataset([b[0] for b in t.calibration])
    compressed = nncf.compress_weights(
        model,
        mode=nncf.CompressWeightsMode.INT4_SYM,
        group_size=32,
        ratio=1.0,
        all_layers=True,
        dataset=dataset,
        **extra,
    )
    with torch.no_grad():
        logits = [compressed(*b) for b in t.test]
    return {"program": metrics(t, logits)}


def main(argv: list[str] | None = None) -> int:
    import nncf

    parser = argparse.ArgumentParser(prog="python -m bench.trained.nncf_side")
    language_models = [m for m in MODELS if m != "digits_cnn"]
    parser.add_argument("--models", nargs="+", default=language_models, choices=MODELS)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", default=str(OUT))
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    warnings.filterwarnings("ignore")
    found: dict[str, Any] = {"nncf": nncf.__version__, "torch": torch.__version__, "models": {}}
    for name in args.models:
        t = task(name)
        rows = found["models"][name] = {}
        for flow, extra in FLOWS.items():
            started = time.perf_counter()
            try:
                rows[flow] = run_flow(t, extra)
            except Exception as exc:  # a flow NNCF cannot run on this model is a row saying so
                first = str(exc).splitlines()[0][:160] if str(exc) else ""
                rows[flow] = {"error": f"{type(exc).__name__}: {first}"}
            rows[flow]["seconds"] = round(time.perf_counter() - started, 2)
            print(name, flow, rows[flow], flush=True)
    Path(args.out).write_text(json.dumps(found, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
