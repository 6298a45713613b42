"""``Quantizer.coverage`` tells what ``prepare`` annotates: both run one declared rewrite pipeline.

Before, ``coverage()`` hand-copied 2 of the 6 rewrites prepare runs before annotation, so on a
program with an embedding bag, an unread write or a weight written in place it reported nodes that
prepare rewrites away (or misses the ones it makes). Now both run
:data:`_quantplug.rewrites.pipeline.PIPELINE`; this test holds them to the same per-node decision
(quantized or float) on the zoo's architectures, for two backends.
"""

from __future__ import annotations

import functools
from typing import Any

import pytest
import torch

import quantplug
from _quantplug.graph.working_copy import working_copy
from _quantplug.meta import STATE_KEY
from _quantplug.quantizer.quantizer import coverage_of
from _quantplug.rewrites.pipeline import PIPELINE, When, rewrite_for_annotation
from _quantplug.sharing.resolution import SharingGroups
from tests.zoo import harness
from tests.zoo.models import MODELS as ZOO
from tests.zoo.more_models import MORE_MODELS

#: a batch-norm CNN, a U-Net, an LSTM, transformers' encoders and decoders (GPT-2's Conv1D, Falcon's
#: hand-written linears), an embedding bag, and RWKV (weights written on the first forward)
MODELS = ("resnet18", "unet", "lstm", "bert", "gpt2", "llama", "falcon", "mha", "embedding", "rwkv")
QUANTIZERS = {
    "reference int8": ("reference", {"preset": "int8"}),
    "qnn_htp 16a8w": ("qnn_htp", {"precision": "16a8w"}),
}


@functools.lru_cache(maxsize=1)  # the cases run model by model: one program held at a time
def _program(name: str) -> torch.export.ExportedProgram:
    return harness.float_case(name).program


def _decisions(report: quantplug.CoverageReport) -> dict[str, bool]:
    return {n.node: n.quantized for n in report.nodes}


def _prepared_decisions(prepared: Any, backend: str) -> dict[str, bool]:
    """Per op node of the prepared program: whether prepare kept an encoding of it (its
    annotations, less what observer sharing dropped), as ``coverage`` decides it."""
    state = prepared.meta[STATE_KEY]
    return _decisions(coverage_of(prepared, SharingGroups(group_of=dict(state.group_of)), backend=backend))


@pytest.mark.parametrize("quantizer", QUANTIZERS)
@pytest.mark.parametrize("name", MODELS)
def test_coverage_decides_every_node_as_prepare_annotates_it(name: str, quantizer: str) -> None:
    zoo = ZOO.get(name) or MORE_MODELS.get(name)
    if zoo is not None and not zoo.available():
        pytest.skip(f"{zoo.needs} is not installed")
    if name == "rwkv":
        pytest.importorskip("transformers")
    backend, options = QUANTIZERS[quantizer]
    program = _program(name)
    q = quantplug.get_quantizer(backend, **options)
    with harness.quiet():
        covered = _decisions(q.coverage(program))
        prepared = quantplug.prepare(program, q)
    done = _prepared_decisions(prepared, backend)
    assert covered == done
    assert any(covered.values()), "nothing quantized: the comparison would hold for any rewrite"


def test_coverage_of_a_qat_quantizer_keeps_batch_norms_as_prepare_does() -> None:
    """A quantizer built for QAT is prepared with ``qat=True``, which folds no batch norm: its
    coverage reports the batch norms prepare annotates. (prepare then rewrites each conv -> batch
    norm into the simulated-folding form: those nodes of its own are not the program's.)"""
    program = _program("resnet18")
    q = quantplug.get_quantizer("qnn_htp", precision="16a8w", qat=True)
    with harness.quiet():
        covered = q.coverage(program)
        prepared = quantplug.prepare(program, q, qat=True)
    assert any("batch_norm" in n.op for n in covered.nodes)
    decided = _prepared_decisions(prepared, "qnn_htp")
    assert len(decided) > len(_decisions(covered))  # the folding form is there
    assert _decisions(covered) == {k: v for k, v in decided.items() if k in _decisions(covered)}


def test_the_pipeline_runs_each_step_under_its_condition() -> None:
    program = _program("resnet18")
    for qat in (False, True):
        for algorithms in (False, True):
            ran = rewrite_for_annotation(working_copy(program), qat=qat, algorithms=algorithms)
            expected = [s.name for s in PIPELINE if s.when.holds(qat=qat, algorithms=algorithms)]
            assert ran == expected
            assert ("fold_batch_norm" in ran) is not qat
            assert ("linear_from_addmm" in ran) is (algorithms and not qat)
    assert {s.when for s in PIPELINE} == set(When)


def test_batch_norm_folding_removes_what_torchs_dead_code_pass_removes(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The fold's own dead-code pass (torch's without its lint) leaves the graph torch's leaves:
    the folded batch norms, their unread parameters, and any other unused pure node."""
    from _quantplug.rewrites import batchnorm

    class ConvBn(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.conv = torch.nn.Conv2d(3, 4, 3)
            self.bn = torch.nn.BatchNorm2d(4)
            self.conv2 = torch.nn.Conv2d(4, 4, 1, bias=False)
            self.bn2 = torch.nn.BatchNorm2d(4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.bn2(self.conv2(torch.relu(self.bn(self.conv(x)))))

    program = torch.export.export(ConvBn().eval(), (torch.randn(1, 3, 8, 8),))

    def folded() -> list[tuple[str, str, str, str]]:
        gm = working_copy(program)
        x = next(n for n in gm.graph.nodes if n.op == "placeholder")
        with gm.graph.inserting_after(x):  # dead, pure: both passes remove it
            gm.graph.call_function(torch.ops.aten.neg.default, (x,))
        assert batchnorm.fold_batch_norm(gm) == 2
        return [(n.name, n.op, str(n.target), str(n.args)) for n in gm.graph.nodes]

    ours = folded()
    monkeypatch.setattr(batchnorm, "eliminate_dead_code", lambda gm: gm.graph.eliminate_dead_code())
    assert ours == folded()
    assert not any("batch_norm" in target or target == "aten.neg.default" for _, _, target, _ in ours)
