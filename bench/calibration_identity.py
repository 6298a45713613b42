"""Calibration identity check: the same observer states, qparams and converted programs, bit for bit,
from two checkouts (issue 43.3: calibration made cheaper must give today's results).

    PYTHONPATH=<old checkout's core and plugins>:. python -m bench.calibration_identity dump /tmp/old.pt
    PYTHONPATH=<new checkout's core and plugins>:. python -m bench.calibration_identity dump /tmp/new.pt
    python -m bench.calibration_identity compare /tmp/old.pt /tmp/new.pt

Per model (bench's decoder-2 and resnet18, qnn_htp test models, tiny Llama and GPT-2, masked
attention) and flow (X86 through quantplug, every reference and qnn_htp preset with activation
observer variants): prepare, 5 calibration batches (ranges that grow, then a batch again), convert;
recorded: every observer buffer, the converted state_dict, the Q/DQ nodes' arguments, the
converted output on a held-out batch. About a minute on one core.

Cases ending in ``/grad`` calibrate with autograd on (no ``torch.no_grad()``, as many users
calibrate: the parameters require grad, so the activations do too) for the flows of
:data:`GRAD_FLOWS`.
"""

import sys
import warnings

import torch

import quantplug

warnings.filterwarnings("ignore")
torch.set_num_threads(1)


def quantizer(f):
    if f == "x86":
        from bench.run import _x86_quantizer

        return _x86_quantizer()
    backend, _, preset = f.partition(":")
    opts = {}
    if "+" in preset:
        preset, *extras = preset.split("+")
        for extra in extras:
            if extra == "et":
                from quantplug_qnn_htp import EXECUTORCH_DEFAULTS

                opts.update(EXECUTORCH_DEFAULTS)
            else:
                k, v = extra.split("=")
                opts[k] = v
    key = "precision" if backend == "qnn_htp" else "preset"
    return quantplug.get_quantizer(backend, **{key: preset}, **opts)


def models():
    from bench.models import build

    out = {}
    for name in ("decoder-2", "resnet18"):
        m, batch = build(name)
        out[name] = (m, [batch(s) for s in (10, 11, 12, 13, 10)], batch(99))
    from tests.qnn_htp.models import build as qbuild

    for name in ("attention", "convnet", "embedding", "group_norm"):
        m, _ex, batches = qbuild(name)
        out[name] = (m, batches[:5], batches[5])
    from tests.qnn_htp.real_models import tiny_gpt2, tiny_llama, token_batches

    for name, m in (("tiny_llama", tiny_llama()), ("tiny_gpt2", tiny_gpt2())):
        toks = token_batches(64, (1, 16), 6)
        out[name] = (m, [(t,) for t in toks[:5]], (toks[5],))
    from tests.qnn_htp.attention_models import SdpaBlock

    g = torch.Generator().manual_seed(3)
    torch.manual_seed(0)
    for tag, kw in (("sdpa_causal", dict(causal=True)), ("sdpa_float", dict(mask="float"))):
        m = SdpaBlock(**kw).eval()
        bs = [(torch.randn(1, 8, 32, generator=g) * (1 + i),) for i in range(6)]
        out[tag] = (m, bs[:5], bs[5])
    return out


FLOWS = [
    "x86",
    "reference:int8",
    "reference:int8_per_tensor",
    "reference:a16w8",
    "reference:int8+activation_observer=minmax",
    "reference:a16w8+activation_observer=moving_average",
    "reference:weight_only_int4",
    "reference:dynamic_int8",
    "qnn_htp:8a8w",
    "qnn_htp:16a8w",
    "qnn_htp:16a4w",
    "qnn_htp:16a16w",
    "qnn_htp:8a4w",
    "qnn_htp:16a2w",
    "qnn_htp:16a4w_block",
    "qnn_htp:16a8w+et",
    "qnn_htp:8a8w+act_observer=histogram",
    "qnn_htp:16a8w+act_observer=moving_average",
]

#: flows also calibrated with autograd on (the range observers' path for tensors requiring grad)
GRAD_FLOWS = [
    "reference:int8+activation_observer=minmax",
    "reference:a16w8+activation_observer=moving_average",
    "qnn_htp:16a8w",
    "qnn_htp:16a8w+et",
    "qnn_htp:8a8w+act_observer=histogram",
]


def bits(t):
    t = t.detach().contiguous()
    if t.is_floating_point():
        return (
            str(t.dtype),
            tuple(t.shape),
            t.view(
                torch.int32
                if t.element_size() == 4
                else torch.int16
                if t.element_size() == 2
                else torch.int64
            ).clone(),
        )
    return (str(t.dtype), tuple(t.shape), t.clone())


def snapshot(flow, model, batches, test, grad=False):
    import quantplug
    from _quantplug.meta import observer_children

    ep = torch.export.export(model, batches[0])
    p = quantplug.prepare(ep, quantizer(flow))
    with torch.enable_grad() if grad else torch.no_grad():
        for b in batches:
            p(*b)
    snap = {}
    for name, obs in observer_children(p):
        for k, v in [
            *list(obs.state_dict(keep_vars=True).items()),
            ("num_batches", getattr(obs, "num_batches", None)),
        ]:
            if isinstance(v, torch.Tensor):
                snap[f"obs/{name}/{k}"] = bits(v)
    c = quantplug.convert(p)
    for k, v in c.state_dict().items():
        snap[f"sd/{k}"] = bits(v)
    for n in c.graph.nodes:
        if n.op == "call_function" and ("quantize" in str(n.target)):
            snap[f"node/{n.name}"] = repr(
                (str(n.target), [a if not isinstance(a, torch.fx.Node) else a.name for a in n.args])
            )
        if n.op == "get_attr":
            v = getattr(c, n.target, None)
            if isinstance(v, torch.Tensor):
                snap[f"attr/{n.target}"] = bits(v)
    with torch.no_grad():
        o = c(*test)
    snap["output"] = bits(o if isinstance(o, torch.Tensor) else o[0])
    return snap


def dump(path, only=None):
    res = {}
    for mname, (m, batches, test) in models().items():
        for flow in FLOWS:
            if only and only not in f"{mname}/{flow}":
                continue
            if flow == "x86" and mname not in ("decoder-2", "resnet18"):
                continue
            for grad in (False, True) if flow in GRAD_FLOWS else (False,):
                case = f"{mname}/{flow}/grad" if grad else f"{mname}/{flow}"
                try:
                    res[case] = snapshot(flow, m, batches, test, grad)
                except Exception as e:
                    res[case] = {"error": repr(e)[:300]}
    torch.save(res, path)
    print(len(res), "cases;", sum(1 for v in res.values() if "error" in v), "errors")


def same(a, b):
    if isinstance(a, tuple):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    if isinstance(a, torch.Tensor):
        return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    return a == b


def compare(pa, pb, strict_obs=True):
    a, b = torch.load(pa, weights_only=False), torch.load(pb, weights_only=False)
    bad = 0
    for case in sorted(set(a) | set(b)):
        sa, sb = a.get(case), b.get(case)
        if sa is None or sb is None:
            print("MISSING", case)
            bad += 1
            continue
        keys = set(sa) | set(sb)
        diffs = [k for k in sorted(keys) if not (k in sa and k in sb and same(sa[k], sb[k]))]
        if diffs:
            bad += 1
            print("DIFF", case, len(diffs), diffs[:6], sa.get("error"), sb.get("error"))
    print(f"{len(a)} cases, {bad} differ")


if __name__ == "__main__":
    if sys.argv[1] == "dump":
        dump(sys.argv[2], sys.argv[3] if len(sys.argv) > 3 else None)
    else:
        compare(sys.argv[2], sys.argv[3])
