"""Before/after checker for convert: the converted programs of two checkouts, bit for bit.

    PYTHONPATH=<checkout A's core and plugins> python -m bench.convert_identity dump a.pt
    PYTHONPATH=<checkout B's> python -m bench.convert_identity dump b.pt --release --slice 100
    python -m bench.convert_identity compare a.pt b.pt      # exit 1 naming every difference

A 2-layer transformers Llama (random weights, 3 calibration batches) through ``qnn_htp`` at 8a8w,
16a8w, 16a4w, 16a4w_block and 16a16w, and ``reference``; and the bench's ResNet18 and a small
conv/conv-transpose/batch-norm CNN (their batch norms folded at prepare, one with eps 1e-3 and no
conv bias) through torchao's X86InductorQuantizer and ``reference``. Per program: every tensor of
its state (bytes, dtype, shape, strides), every group's qparams, its code and its output on a batch.
``--release`` converts with ``release_float_weights=True``; ``--slice N`` quantizes constants in
slices of N elements (many slices per weight) instead of the default 4 MiB.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

FLOWS = [("qnn_htp", p) for p in ("8a8w", "16a8w", "16a4w", "16a4w_block", "16a16w")] + [("reference", None)]
#: (model, quantizer) of the batch-norm CNN programs
CNN_FLOWS = [(m, q) for m in ("resnet18", "convbn") for q in ("x86", "reference")]


def _conv_bn_model() -> Any:
    """A CNN whose folds take every path: a conv with bias, a conv transpose without, eps 1e-3."""
    import torch

    from bench.models import _randomize_bn

    class ConvBn(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.conv = torch.nn.Conv2d(3, 12, 3, padding=1)
            self.bn = torch.nn.BatchNorm2d(12)
            self.up = torch.nn.ConvTranspose2d(12, 5, 2, stride=2, bias=False)
            self.bn_up = torch.nn.BatchNorm2d(5, eps=1e-3)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return torch.relu(self.bn_up(self.up(torch.relu(self.bn(self.conv(x))))))

    torch.manual_seed(0)
    model = ConvBn().eval()
    _randomize_bn(model, torch.Generator().manual_seed(1))
    return model


def _cnn_programs(found: dict[str, Any], release: bool, record: Any) -> None:
    import torch
    from torchao.quantization.pt2e.quantizer.x86_inductor_quantizer import (
        X86InductorQuantizer,
        get_default_x86_inductor_quantization_config,
    )

    import quantplug
    from bench.models import build

    for name, kind in CNN_FLOWS:
        if name == "resnet18":
            model, make = build("resnet18")
            batches = [make(s) for s in range(3)]
        else:
            model = _conv_bn_model()
            g = torch.Generator().manual_seed(2)
            batches = [(torch.randn(1, 3, 16, 16, generator=g),) for _ in range(3)]
        quantizer = (
            X86InductorQuantizer().set_global(get_default_x86_inductor_quantization_config())
            if kind == "x86"
            else quantplug.get_quantizer("reference")
        )
        prepared = quantplug.prepare(torch.export.export(model, batches[0]), quantizer)
        with torch.no_grad():
            for batch in batches:
                prepared(*batch)
        converted = quantplug.convert(prepared, **({"release_float_weights": True} if release else {}))
        found[f"{name}-{kind}"] = record(converted, batches[0])


def dump(out: str, release: bool, slice_elements: int | None) -> None:
    import torch
    import transformers

    import _quantplug.flow.convert as convert_module
    import quantplug
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
        found[f"{backend}-{precision}"] = _record(converted, batches[0])
    _cnn_programs(found, release, _record)
    torch.save(found, out)


def _record(converted: Any, batch: tuple[Any, ...]) -> dict[str, Any]:
    """What is compared of one converted program."""
    import torch

    from _quantplug.meta import QPARAMS_KEY

    state = converted.state_dict()
    with torch.no_grad():
        output = converted(*batch)
    return {
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
    print(f"{len(differences)} difference(s) over {len(FLOWS) + len(CNN_FLOWS)} programs")
    return 1 if differences else 0


if __name__ == "__main__":
    sys.exit(main())
