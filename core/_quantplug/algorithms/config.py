"""The accuracy algorithms prepare runs, with the data and the guard they run with: one argument.

``prepare(program, quantizer, algorithms=Algorithms(["smoothquant", "gptq"], calibration=batches,
held_out=other_batches))``: everything about the algorithms is configured in one object, so
``prepare`` keeps the design's signature (``prepare(program, quantizer, *, qat=False)``, plus
``nonfinite``). A plain list (``algorithms=["gptq"]``) is ``Algorithms(["gptq"])``.

Until 0.2.0, prepare took ``calibration=``, ``algorithm_guard=`` and ``held_out=`` beside
``algorithms=``; they keep working until 0.4.0 with a :class:`DeprecationWarning`
(:func:`configured`, :data:`_quantplug.deprecated.KEYWORDS`).

Imports neither torch nor any algorithm: names are resolved by ``prepare``
(:func:`~_quantplug.algorithms.registry.resolve_algorithms`), each time it runs.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from _quantplug.deprecated import warn_old_keyword
from _quantplug.errors import OptionError

#: prepare's keywords before :class:`Algorithms` -> the field of Algorithms each became
OLD_KEYWORDS = {"calibration": "calibration", "algorithm_guard": "guard", "held_out": "held_out"}
#: ``Algorithms(..., held_out=ON_CALIBRATION)``: the guard judges on the calibration batches
ON_CALIBRATION = "calibration"


@dataclass(frozen=True, init=False, eq=False, repr=False)
class Algorithms:
    """Accuracy algorithms for ``prepare(..., algorithms=...)``, with their data and guard.

    Args:
        algorithms: in order: names from ``quantplug.list_algorithms()``, ``(name, {option:
            value})`` pairs or configured objects (see ``quantplug.Algorithm``); one name or object
            alone is a list of one. Unknown names raise
            :class:`~_quantplug.errors.UnknownAlgorithmError` when ``prepare`` runs.
        calibration: batches (tuples of the program's inputs) for algorithms that need data before
            annotation (SmoothQuant, CLE's guard); calibrating the prepared module is still the
            caller's loop.
        guard: select which layers keep the algorithms' weight choice (the others are rounded to
            nearest) by the quantized model's output error on the first calibration batches, and
            undo a transform whose quantized program does worse on the ``calibration`` batches
            (:mod:`_quantplug.algorithms.guard`), so algorithms never make the model worse than the
            default on those batches (beyond a 0.004 dB tie margin, float noise); ``False`` keeps
            every choice.
        held_out: batches not calibrated on (as ``calibration``'s) for the guard to judge on
            (the first 8, at most 32 MiB of them). The algorithms fit their choices to the
            calibration data, where a choice that overfits (GPTQ on a layer that saw fewer rows
            than it has inputs; SeqMSE on a trained LSTM) still looks good; judged on held-out
            data it is refused, and the guarantee reads "never worse than the default on the
            held-out batches". By default (None) every 4th calibration batch is held out: the
            algorithms (and the transforms, of ``calibration``'s batches) do not see it, the
            guard judges on it; with fewer than 4 batches nothing is held out.
            ``"calibration"``: no split, the guard judges on the calibration batches the
            algorithms fitted (0.1's behaviour). Needs the guard.
        guard_loss: the task's loss for the guard to minimise instead of the output error against
            float: ``guard_loss(outputs, inputs) -> float`` for one batch, where ``outputs`` are
            the quantized model's floating-point output tensors (in pytree order, float64) and
            ``inputs`` the batch's flat inputs; lower is better, never negative (a NaN or inf
            counts as the worst). Closer to float is not always better for the task: on a
            byte-level LSTM trained here, SeqMSE at 16a4w_block brings the logits closer to float
            (error -41 %, KL -44 % on the test text) and still raises the next-byte
            cross-entropy there (+0.0027 nats); the held-out batches' own cross-entropy shows the
            loss (+0.0027), the output error does not. A language model's loss needs no labels::

                def next_token(outputs, inputs):
                    logits, tokens = outputs[0], inputs[0]
                    return F.cross_entropy(logits[:, :-1].flatten(0, 1), tokens[:, 1:].flatten()).item()

            Needs the guard.
    """

    algorithms: tuple[Any, ...]
    calibration: Sequence[Any] | None
    guard: bool
    held_out: Sequence[Any] | str | None
    guard_loss: Callable[[list[Any], tuple[Any, ...]], float] | None

    def __init__(
        self,
        algorithms: Iterable[Any] | str | Any = (),
        *,
        calibration: Sequence[Any] | None = None,
        guard: bool = True,
        held_out: Sequence[Any] | str | None = None,
        guard_loss: Callable[[list[Any], tuple[Any, ...]], float] | None = None,
    ) -> None:
        if not isinstance(guard, bool):
            raise OptionError(
                f"guard must be True or False, got {guard!r}; pass "
                "Algorithms([...], guard=False) to keep every choice of the algorithms"
            )
        if isinstance(held_out, str) and held_out != ON_CALIBRATION:
            raise OptionError(
                f"held_out must be batches, None (every 4th calibration batch held out) or "
                f"{ON_CALIBRATION!r} (judged on the calibration batches), got {held_out!r}"
            )
        if held_out is not None and not guard:
            raise OptionError(
                "held_out batches are what the algorithm guard judges on, and guard=False turns the "
                "guard off; pass one or the other"
            )
        if guard_loss is not None and not callable(guard_loss):
            raise OptionError(f"guard_loss must be a function (outputs, inputs) -> float, got {guard_loss!r}")
        if guard_loss is not None and not guard:
            raise OptionError(
                "guard_loss is what the algorithm guard minimises, and guard=False turns the guard "
                "off; pass one or the other"
            )
        if isinstance(algorithms, (str, bytes)) or not isinstance(algorithms, Iterable):
            algorithms = (algorithms,)
        object.__setattr__(self, "algorithms", tuple(algorithms))
        object.__setattr__(self, "calibration", calibration)
        object.__setattr__(self, "guard", guard)
        object.__setattr__(self, "held_out", held_out)
        object.__setattr__(self, "guard_loss", guard_loss)

    def __repr__(self) -> str:
        shown = [repr(list(self.algorithms))]
        for name in ("calibration", "held_out"):
            batches = getattr(self, name)
            if isinstance(batches, str):
                shown.append(f"{name}={batches!r}")
            elif batches is not None:
                count = len(batches) if isinstance(batches, Sequence) else "?"
                shown.append(f"{name}=<{count} batches>")
        if not self.guard:
            shown.append("guard=False")
        if self.guard_loss is not None:
            shown.append(f"guard_loss={getattr(self.guard_loss, '__name__', type(self.guard_loss).__name__)}")
        return f"Algorithms({', '.join(shown)})"


def configured(algorithms: Any, old: Mapping[str, Any], *, function: str) -> Algorithms:
    """``function``'s ``algorithms`` argument as :class:`Algorithms`, taking the deprecated keywords
    ``old`` (:data:`OLD_KEYWORDS`, each warned about) into it. Any other keyword is a TypeError, as
    Python gives it; the old keywords beside an :class:`Algorithms` are an OptionError (which to
    believe?)."""
    unknown = [k for k in old if k not in OLD_KEYWORDS]
    if unknown:
        raise TypeError(f"{function}() got an unexpected keyword argument {unknown[0]!r}")
    if isinstance(algorithms, Algorithms):
        if old:
            given = ", ".join(f"{k}=" for k in old)
            raise OptionError(
                f"{function}() got algorithms=Algorithms(...) and {given}: configure the algorithms "
                "in one place, Algorithms([...], calibration=..., guard=..., held_out=...)"
            )
        return algorithms
    for keyword in old:
        warn_old_keyword(function, keyword, stacklevel=4)
    return Algorithms(
        () if algorithms is None else algorithms, **{OLD_KEYWORDS[k]: value for k, value in old.items()}
    )
