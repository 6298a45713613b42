"""Before/after checker for convert: the converted programs of two checkouts, bit for bit.

    PYTHONPATH=<checkout A's core and plugins> python -m bench.convert_identity dump a.pt
    PYTHONPATH=<checkout B's> python -m bench.convert_identity dump b.pt --release --slice 100
    python -m bench.convert_identity compare a.pt b.pt      # exit 1 naming every difference

A 2-layer transformers Llama (random weights, 3 calibration batches) through ``qnn_htp`` at 8a8w,
16a8w, 16a4w, 16a4w_block and 16a16w, and ``reference``; per program: every tensor of its state
(bytes, dtype, shape, strides), every group's qparams, its code and its output on a batch.
``--release`` converts with ``release_float_weights=True``; ``--slice N`` quantizes constants in
slices of N elements (many slices per weight) instead of the default 4 MiB.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

FLOWS = [("qnn_htp", p) for p in ("8a8w", "16a8w", "16a4w", "16a4w_block", "16a16w")] + [("reference", None)]


def dump(out: str, release: bool, slice_elements: int | None) -> None:
    import torch
    import transformers

    import _quantplug.flow.convert as convert_module
    import quantplug
    from _quantplug.meta import QPARAMS_KEY
    from bench.algorithm_models import LogitsOnly

    if slice_elements is not None:
        convert_module.SLICE_ELEMENTS = slice_elements  # type: ignore[attr-defined]
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=512, hidden_size=64, intermediate_size=192, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, use_cache=False, tie_word_embeddings=False,
    )  # fmt: skip
    model = LogitsOnly(transformers.LlamaForCausalLM(config)).eval()
    g = torch.Generator().manual_seed(1)
    batches = [(torch.randint(0, 512, (1, 16), generator=g),) for _ in range(3)]
    found: dict[str, Any] = {}
    for backend, precision in FLOWS:
        quantizer = quantplug.get_quantizer(backend, **({"precision": precision} if precision else {}))
        prepared = quantplug.prepare(torch.export.export(model, batches[0]), quantizer)
        with torch.no_grad():
            for batch in batches:
                prepared(*batch)
        converted = quantplug.convert(prepared, **({"release_float_weights": True} if release else {}))
        state = converted.state_dict()
        with torch.no_grad():
            output = converted(*batches[0])
        found[f"{backend}-{precision}"] = {
            "tensors": {k: v.detach().clone() for k, v in state.items()},
            "strides": {k: v.stride() for k, v in state.items()},
            "qparams": {
                gid: (
                    qp.scale,
                    qp.zero_point,
                    qp.quant_min,
                    qp.quant_max,
                    str(qp.dtype),
                    qp.granularity,
                    qp.axis,
                    qp.block_size,
                )
                for gid, qp in converted.meta[QPARAMS_KEY].items()
            },
            "code": converted.code,
            "output": output,
        }
    torch.save(found, out)


def _bits(t: Any) -> Any:
    import torch

    return t.contiguous().view(-1).view(torch.uint8) if t.is_floating_point() else t


def compare(a_path: str, b_path: str) -> list[str]:
    import torch

    a, b = torch.load(a_path, weights_only=False), torch.load(b_path, weights_only=False)
    differences = []
    for flow, left in a.items():
        right = b[flow]
        if left["tensors"].keys() != right["tensors"].keys():
            differences.append(f"{flow}: tensors {sorted(set(left['tensors']) ^ set(right['tensors']))}")
        for name, x in left["tensors"].items():
            y = right["tensors"].get(name)
            same = (
                y is not None
                and x.dtype == y.dtype
                and x.shape == y.shape
                and torch.equal(_bits(x), _bits(y))
            )
            if not same or left["strides"][name] != right["strides"][name]:
                differences.append(f"{flow}: tensor {name}")
        for gid, p in left["qparams"].items():
            q = right["qparams"].get(gid)
            if q is None or not (torch.equal(p[0], q[0]) and torch.equal(p[1], q[1]) and p[2:] == q[2:]):
                differences.append(f"{flow}: qparams of group {gid}")
        if left["code"] != right["code"]:
            differences.append(f"{flow}: code")
        if not torch.equal(left["output"], right["output"]):
            differences.append(f"{flow}: output")
    return differences


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench.convert_identity", description=__doc__.split("\n")[0]
    )
    sub = parser.add_subparsers(dest="command", required=True)
    d = sub.add_parser("dump")
    d.add_argument("out")
    d.add_argument("--release", action="store_true")
    d.add_argument("--slice", type=int, default=None)
    c = sub.add_parser("compare")
    c.add_argument("a")
    c.add_argument("b")
    args = parser.parse_args(argv)
    if args.command == "dump":
        dump(args.out, args.release, args.slice)
        return 0
    differences = compare(args.a, args.b)
    for line in differences:
        print(line)
    print(f"{len(differences)} difference(s) over {len(FLOWS)} programs")
    return 1 if differences else 0


if __name__ == "__main__":
    sys.exit(main())
