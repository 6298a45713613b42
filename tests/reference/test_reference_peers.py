"""The reference backend's ONNX Runtime pieces are listed with the versions they were read on.

When the test environment's onnxruntime moves past the table, this fails naming each piece to
recheck (its defect or kernel model) before the table gains the new version."""

from __future__ import annotations

import pkgutil

import quantplug_reference.peers as peers
from quantplug_reference.peers import VERIFIED_ON, unverified


def test_every_module_of_the_folder_is_in_the_table() -> None:
    modules = {m.name for m in pkgutil.iter_modules(peers.__path__)}
    assert modules == set(VERIFIED_ON)


def test_the_installed_onnxruntime_is_one_the_pieces_were_read_on() -> None:
    assert unverified() == [], "recheck these pieces against the installed ORT:\n" + "\n".join(unverified())


def test_an_artifact_records_what_is_unverified() -> None:
    import torch

    import quantplug

    program = torch.export.export(torch.nn.Linear(8, 4).eval(), (torch.randn(2, 8),))
    quantizer = quantplug.get_quantizer("reference")
    prepared = quantplug.prepare(program, quantizer)
    prepared(torch.randn(2, 8))
    artifact = quantplug.lower(quantplug.convert(prepared), quantizer)
    assert artifact.metadata["ort_unverified"] == unverified()
