"""``.train()`` / ``.eval()`` refused on prepared and converted modules, as on exported ones.

An exported program is specialized to the mode it was exported in: its dropout and batch-norm
ops already say train or eval, and ``nn.Module.train()`` flips a flag no op reads. torch refuses
both methods on ``ExportedProgram.module()`` for that reason, and torchao's ``prepare_pt2e`` /
``convert_pt2e`` keep refusing them on what they return. quantplug's modules do the same (a PT2E
user switching must not find a silent no-op where they had an error), and the two ways out work
as they do there: ``torchao.quantization.pt2e.move_exported_model_to_eval(m)`` (or ``_to_train``)
rewrites the dropout and batch-norm ops, and ``allow_exported_model_train_eval(m)`` installs
``train``/``eval`` on the instance that do that rewrite (an instance attribute overrides the
methods here).
"""

from __future__ import annotations

from typing import Any, NoReturn

TRAIN_EVAL_MESSAGE = (
    "Calling train() or eval() is not supported for exported models (their dropout and batch-norm "
    "ops are fixed at export). Call torchao.quantization.pt2e.move_exported_model_to_train(model) "
    "(or move_exported_model_to_eval) instead, or call "
    "torchao.quantization.pt2e.allow_exported_model_train_eval(model) once, which makes "
    "model.train()/model.eval() do that rewrite (dropout and batch norm only)."
)


class ExportedModes:
    """Mixin for a GraphModule class: ``train``/``eval`` raise ``NotImplementedError`` as
    torch's and torchao's exported modules do (the same exception type, so code written for them,
    ``except NotImplementedError``, behaves the same)."""

    def train(self, mode: bool = True) -> NoReturn:
        raise NotImplementedError(TRAIN_EVAL_MESSAGE)

    def eval(self, *args: Any) -> NoReturn:
        raise NotImplementedError(TRAIN_EVAL_MESSAGE)
