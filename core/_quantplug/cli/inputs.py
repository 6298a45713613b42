"""What ``quantplug quantize`` reads: the model (a .pt2 file, a ``module:factory``, or the built-in
demo) and the calibration data (a .pt file or a folder of them), checked against the model."""

from __future__ import annotations

import importlib
import os
import sys
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from itertools import islice
from pathlib import Path
from typing import Any

import torch

from _quantplug.cli.checks import FACTORY
from _quantplug.cli.errors import InputError
from _quantplug.errors import NonFiniteError, QuantplugError, UnsafeArchiveError
from _quantplug.graph.calls import Call, in_spec_of, unflatten
from _quantplug.plugins.culprit import culprit, exit_call

__all__ = [
    "CalibrationData",
    "InputError",
    "InputSpec",
    "ModelInput",
    "check_batches",
    "load_calibration",
    "load_model",
    "open_calibration",
]

DATA_SUFFIXES = (".pt", ".pth")


@dataclass(frozen=True)
class InputSpec:
    """One positional input of the program."""

    name: str
    shape: tuple[Any, ...]  # ints, or None for a dynamic dimension
    dtype: torch.dtype | None

    def describe(self) -> str:
        dims = ", ".join("?" if d is None else str(d) for d in self.shape)
        dtype = str(self.dtype).removeprefix("torch.") if self.dtype is not None else "?"
        return f"({dims}) {dtype}"

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "shape": list(self.shape),
            "dtype": str(self.dtype).removeprefix("torch.") if self.dtype is not None else None,
        }


@dataclass
class ModelInput:
    program: torch.export.ExportedProgram
    source: str  # what the user gave, for messages and the report
    kind: str  # "demo", "pt2" or "factory"
    name: str
    calibration: list[Call] | None = None  # built-in data (demo only)
    inputs: list[InputSpec] = field(default_factory=list)

    def describe(self) -> dict[str, Any]:
        ops = sum(1 for n in self.program.graph.nodes if n.op == "call_function")
        return {
            "source": self.source,
            "kind": self.kind,
            "name": self.name,
            "ops": ops,
            "inputs": [i.to_dict() for i in self.inputs],
        }


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0]}" if text else type(exc).__name__


def input_specs(program: torch.export.ExportedProgram) -> list[InputSpec]:
    user_inputs = list(program.graph_signature.user_inputs)
    nodes = {n.name: n for n in program.graph.nodes if n.op == "placeholder"}
    specs = []
    for name in user_inputs:
        node = nodes.get(str(name))
        val = node.meta.get("val") if node is not None else None
        if isinstance(val, torch.Tensor):
            shape = tuple(d if isinstance(d, int) else None for d in val.shape)
            specs.append(InputSpec(str(name), shape, val.dtype))
        else:
            specs.append(InputSpec(str(name), (), None))
    return specs


def _model_from_pt2(path: Path, *, allow_pickle: bool) -> ModelInput:
    from _quantplug.archive import load_program

    if path.is_dir():
        raise InputError(f"model {str(path)!r} is a folder; expected a torch.export.save()d .pt2 file")
    try:
        program = load_program(path, allow_pickle=allow_pickle)
    except UnsafeArchiveError:
        raise
    except QuantplugError as exc:
        raise InputError(f"cannot load model file {str(path)!r}: {exc}") from exc
    return ModelInput(program, str(path), "pt2", path.stem, inputs=input_specs(program))


@contextmanager
def _working_folder_importable() -> Iterator[None]:
    """Modules in the current folder resolve (like ``python -m``), for this import only: the rest
    of the run must not pick up a ``matplotlib.py`` that happens to sit there."""
    cwd = os.getcwd()
    added = cwd not in sys.path and "" not in sys.path
    if added:
        sys.path.insert(0, cwd)
    try:
        yield
    finally:
        if added and cwd in sys.path:
            sys.path.remove(cwd)


def _model_from_factory(spec: str) -> ModelInput:
    module_name, _, attr = spec.partition(":")
    try:
        module = importlib.import_module(module_name)
    except SystemExit as exc:
        raise InputError(f"importing {module_name!r} for factory {spec!r} called {exit_call(exc)}") from exc
    except Exception as exc:
        raise InputError(f"cannot import {module_name!r} for factory {spec!r}: {_first_line(exc)}") from exc
    target: Any = module
    for part in attr.split("."):
        if not hasattr(target, part):
            raise InputError(f"factory {spec!r}: module {module_name!r} has no attribute {attr!r}")
        target = getattr(target, part)
    if not callable(target):
        raise InputError(f"factory {spec!r} is not callable ({type(target).__name__})")
    try:
        result = target()
    except SystemExit as exc:
        raise InputError(
            f"factory {spec!r} called {exit_call(exc)} instead of returning (model, example_inputs)"
        ) from exc
    except Exception as exc:
        raise InputError(f"factory {spec!r} raised {_first_line(exc)}") from exc
    if not (isinstance(result, (tuple, list)) and len(result) == 2):
        raise InputError(f"factory {spec!r} must return (model, example_inputs), got {type(result).__name__}")
    model, given = result
    if not isinstance(given, (torch.Tensor, tuple, list, dict, Call)):
        raise InputError(
            f"factory {spec!r} returned example_inputs of type {type(given).__name__}; expected a "
            "tuple of tensors, or a dict of keyword inputs"
        )
    try:
        example = Call.of(given)
    except QuantplugError as exc:
        raise InputError(f"factory {spec!r}: {exc}") from exc
    if isinstance(model, torch.export.ExportedProgram):
        program = model
    elif isinstance(model, torch.nn.Module):
        try:
            program = torch.export.export(model.eval(), example.args, dict(example.kwargs))
        except Exception as exc:
            raise InputError(
                f"torch.export could not capture the model from factory {spec!r}: {_first_line(exc)}"
            ) from exc
    else:
        raise InputError(
            f"factory {spec!r} returned a {type(model).__name__} as the model; expected an nn.Module "
            "or an ExportedProgram"
        )
    return ModelInput(program, spec, "factory", attr.rsplit(".", 1)[-1], inputs=input_specs(program))


def load_model(spec: str | None, *, allow_pickle: bool = False) -> ModelInput:
    """The program to quantize: a .pt2 path, a ``package.module:factory``, or None for the demo.

    Both run code (see :mod:`_quantplug.archive`); a .pt2 holding pickled data is refused unless
    ``allow_pickle``.
    """
    if spec is None:
        from _quantplug.demo.model import demo_calibration, demo_model

        model, example = demo_model()
        program = torch.export.export(model, example)
        return ModelInput(
            program,
            "built-in demo (DemoNet: conv-bn-relu, residual block, pool, linear)",
            "demo",
            "DemoNet",
            calibration=[Call.of(b) for b in demo_calibration()],
            inputs=input_specs(program),
        )
    path = Path(spec)
    if path.exists():
        return _model_from_pt2(path, allow_pickle=allow_pickle)
    if FACTORY.fullmatch(spec):
        with _working_folder_importable():  # the factory and the model it builds may import more
            return _model_from_factory(spec)
    raise InputError(
        f"model file {spec!r} not found (give a torch.export.save()d .pt2 file or a "
        "package.module:factory returning (model, example_inputs))"
    )


# ------------------------------------------------------------------------------------------------
# calibration data
# ------------------------------------------------------------------------------------------------


def _load_data_file(path: Path) -> Any:
    """A calibration file's content, its tensors memory-mapped: nothing is read until a batch is
    used, and what was read is file-backed memory the OS can drop again (a file of many batches
    costs no more memory than one batch). Files in torch's legacy format cannot be mapped and are
    read whole. ``weights_only=True`` either way: a calibration file runs no code."""
    try:
        try:
            return torch.load(str(path), map_location="cpu", weights_only=True, mmap=True)
        except RuntimeError as exc:
            if "mmap" not in str(exc) and "zip" not in str(exc):
                raise
            return torch.load(str(path), map_location="cpu", weights_only=True)
    except Exception as exc:
        raise InputError(f"cannot read calibration file {str(path)!r}: {_first_line(exc)}") from exc


def _batches_of(content: Any, inputs: Sequence[InputSpec], origin: str) -> list[Call]:
    """Interpret one file's content as calibration batches.

    A tensor is one batch of a single-input model (or, with one more leading dimension than the
    input, a stack of batches); a tuple of as many tensors as the model has inputs is one batch;
    a dict is one batch of keyword inputs (input name -> tensor); a list (or any other tuple)
    holds one batch per element, each a tensor, a tuple of tensors or a dict.
    """
    count = len(inputs)
    if isinstance(content, torch.Tensor):
        if count == 1 and inputs[0].shape and content.dim() == len(inputs[0].shape) + 1:
            return [Call((t,)) for t in content.unbind(0)]
        return [Call((content,))]
    if isinstance(content, dict):
        return [_keyword_batch(content, origin)]
    if (
        isinstance(content, tuple)
        and count > 1
        and len(content) == count
        and all(isinstance(t, torch.Tensor) for t in content)
    ):
        return [Call(content)]
    if isinstance(content, (list, tuple)):
        return [_one_batch(item, f"{origin}, element {i}") for i, item in enumerate(content)]
    raise InputError(
        f"calibration {origin} holds a {type(content).__name__}; expected a tensor, a tuple of tensors "
        "(one batch), a dict of keyword inputs (one batch) or a list of them (one batch each)"
    )


def _one_batch(item: Any, origin: str) -> Call:
    """One element of a list of batches, or one item of a data factory's iterable."""
    if isinstance(item, Call):
        return item
    if isinstance(item, torch.Tensor):
        return Call((item,))
    if isinstance(item, (list, tuple)):
        return Call(tuple(item))
    if isinstance(item, dict):
        return _keyword_batch(item, origin)
    raise InputError(
        f"calibration {origin} is a {type(item).__name__}; expected a tensor, a tuple of tensors or a "
        "dict of keyword inputs"
    )


def _keyword_batch(content: dict[Any, Any], origin: str) -> Call:
    try:
        return Call.of(content)
    except QuantplugError as exc:
        raise InputError(f"calibration {origin}: {exc}") from exc


#: a batch and where it came from ("file.pt[3]", "factory item 7")
Batch = tuple[Call, str]


class CalibrationData:
    """Calibration batches, read one at a time and never all held (files memory-mapped one by
    one; a factory's iterable consumed as it goes), and shared out between ranks.

    ``batches(rank, world_size)`` yields every ``world_size``-th batch from ``rank`` (round robin
    over the global batch order, so each batch is calibrated exactly once whatever the number of
    processes); a factory that takes ``rank`` and ``world_size`` keyword arguments is given them
    and shards its data itself (a ``DistributedSampler``, say), its items all calibrated.
    """

    def __init__(
        self,
        source: str,
        read: Callable[[int, int], Iterator[Batch]],
        *,
        total: int | Callable[[], int] | None,
        shards_itself: bool = False,
    ) -> None:
        self.source = source
        self._read = read
        self._total = total
        self.shards_itself = shards_itself

    @property
    def total(self) -> int | None:
        """Batches over all ranks where they can be counted without reading them (None: unknown)."""
        if callable(self._total):
            self._total = self._total()
        return self._total

    @classmethod
    def of(cls, batches: Sequence[Call], origins: Sequence[str], source: str) -> CalibrationData:
        pairs = list(zip(batches, origins))
        return cls(source, lambda rank, size: iter(pairs), total=len(pairs))

    def batches(self, rank: int = 0, world_size: int = 1) -> Iterator[Batch]:
        if self.shards_itself:
            return self._read(rank, world_size)
        return islice(self._read(0, 1), rank, None, world_size)

    def head(self, count: int) -> list[Batch]:
        """The first ``count`` batches of the whole data (rank 0 of 1)."""
        return list(islice(self._read(0, 1), count))


def _count_batches(files: Sequence[Path], inputs: Sequence[InputSpec]) -> int:
    """Batches in the files: each file's structure is read, its tensors stay mapped, unread."""
    return sum(len(_batches_of(_load_data_file(f), inputs, f"file {str(f)!r}")) for f in files)


def _file_batches(files: Sequence[Path], inputs: Sequence[InputSpec]) -> Iterator[Batch]:
    for f in files:
        content = _load_data_file(f)
        found = _batches_of(content, inputs, f"file {str(f)!r}")
        del content
        for i, batch in enumerate(found):
            yield batch, f"{f.name}" + (f"[{i}]" if len(found) > 1 else "")


def _data_factory(spec: str) -> tuple[Callable[..., Any], bool]:
    """The callable a ``package.module:factory`` names, and whether it takes rank/world_size."""
    import inspect

    module_name, _, attr = spec.partition(":")
    with _working_folder_importable():
        try:
            target: Any = importlib.import_module(module_name)
        except SystemExit as exc:
            raise InputError(f"importing {module_name!r} for data {spec!r} called {exit_call(exc)}") from exc
        except Exception as exc:
            raise InputError(f"cannot import {module_name!r} for data {spec!r}: {_first_line(exc)}") from exc
    for part in attr.split("."):
        if not hasattr(target, part):
            raise InputError(f"calibration data {spec!r}: module {module_name!r} has no attribute {attr!r}")
        target = getattr(target, part)
    if not callable(target):
        raise InputError(f"calibration data {spec!r} is not callable ({type(target).__name__})")
    try:
        params = inspect.signature(target).parameters
    except (TypeError, ValueError):
        params = {}  # type: ignore[assignment]
    shards = {"rank", "world_size"} <= set(params) or any(p.kind is p.VAR_KEYWORD for p in params.values())
    return target, shards


def _factory_batches(
    spec: str, factory: Callable[..., Any], shards: bool, rank: int, size: int
) -> Iterator[Batch]:
    try:
        iterable = factory(rank=rank, world_size=size) if shards else factory()
        iterator = iter(iterable)
    except SystemExit as exc:
        raise InputError(f"data factory {spec!r} called {exit_call(exc)}") from exc
    except Exception as exc:
        raise InputError(
            f"data factory {spec!r} raised {_first_line(exc)} (it must return an iterable)"
        ) from exc
    index = 0
    while True:
        try:
            item = next(iterator)
        except StopIteration:
            return
        except SystemExit as exc:  # the factory's code ending the run is its failure, not a success
            raise InputError(
                f"data factory {spec!r} called {exit_call(exc)} producing item {index} ({culprit(exc)})"
            ) from exc
        except Exception as exc:
            raise InputError(
                f"data factory {spec!r} failed producing item {index}: {_first_line(exc)}"
            ) from exc
        origin = f"{spec} item {index}"
        yield _one_batch(item, origin), origin
        index += 1


def open_calibration(
    spec: str, inputs: Sequence[InputSpec], what: str = "calibration data"
) -> CalibrationData:
    """Calibration data (or ``what`` else: held-out batches) from a .pt file, a folder of them
    (sorted by name) or a ``package.module:factory`` returning an iterable of batches."""
    path = Path(spec)
    if not path.exists():
        if FACTORY.fullmatch(spec):
            factory, shards = _data_factory(spec)
            return CalibrationData(
                spec,
                lambda rank, size: _factory_batches(spec, factory, shards, rank, size),
                total=None,
                shards_itself=shards,
            )
        raise InputError(
            f"{what} {spec!r} not found (a .pt file, a folder of them or package.module:factory)"
        )
    if path.is_dir():
        files = sorted(p for p in path.iterdir() if p.is_file() and p.suffix in DATA_SUFFIXES)
        if not files:
            raise InputError(f"{what} folder {spec!r} has no {'/'.join(DATA_SUFFIXES)} files")
    else:
        files = [path]
    return CalibrationData(
        spec, lambda rank, size: _file_batches(files, inputs), total=lambda: _count_batches(files, inputs)
    )


def load_calibration(spec: str, inputs: Sequence[InputSpec]) -> tuple[list[Call], list[str]]:
    """Every batch of :func:`open_calibration`'s data, held in memory (for small data and tests)."""
    pairs = list(open_calibration(spec, inputs).batches())
    if not pairs:
        raise InputError(f"calibration data {spec!r} holds no batches")
    return [b for b, _ in pairs], [o for _, o in pairs]


def check_batches(
    batches: Sequence[Call | tuple[Any, ...]],
    origins: Sequence[str],
    inputs: Sequence[InputSpec],
    program: torch.export.ExportedProgram | None = None,
    *,
    finite: bool = False,
    start: int = 0,
    what: str = "calibration",
) -> None:
    """Every batch matches the model's inputs (positional and keyword), each with its dtype and
    (static) shape, and with ``finite``, holds no NaN or infinite values. Keyword inputs are
    matched by the calling convention of ``program``."""
    in_spec = None if program is None else in_spec_of(program)
    for index, (given, origin) in enumerate(zip(batches, origins), start):
        where = f"{what} batch {index} ({origin})"
        flat = _flat_inputs(Call.of(given), in_spec, where)
        if len(flat) != len(inputs):
            raise InputError(
                f"{where} has {len(flat)} input(s); the model takes {len(inputs)} "
                f"({', '.join(i.name for i in inputs)})"
            )
        for value, spec in zip(flat, inputs):
            if spec.dtype is None:
                continue
            if not isinstance(value, torch.Tensor):
                raise InputError(f"{where}: input {spec.name!r} is a {type(value).__name__}, not a tensor")
            shape = tuple(value.shape)
            ok = len(shape) == len(spec.shape) and all(e is None or e == d for e, d in zip(spec.shape, shape))
            if not ok:
                got = "(" + ", ".join(map(str, shape)) + ")"
                raise InputError(
                    f"{where}: input {spec.name!r} has shape {got}; the model expects {spec.describe()}"
                )
            if value.dtype != spec.dtype:
                raise InputError(
                    f"{where}: input {spec.name!r} has dtype {str(value.dtype).removeprefix('torch.')}; "
                    f"the model expects {spec.describe()}"
                )
            if finite:
                found = _nonfinite_text(value)
                if found:
                    raise InputError(
                        f"{where}: input {spec.name!r} holds {found}; remove them from the data, or pass "
                        "--nonfinite ignore to leave them out of the calibration statistics"
                    )


def _flat_inputs(batch: Call, in_spec: Any, where: str) -> list[Any]:
    if not batch.kwargs:
        return list(batch.args)
    try:
        return batch.flat(in_spec, "the model")
    except QuantplugError as exc:
        raise InputError(f"{where}: {exc}") from exc


def _nonfinite_text(value: torch.Tensor) -> str:
    """``"3 NaN and 1 inf value(s), the first at index (0, 2)"``, or "" when all are finite."""
    if not value.dtype.is_floating_point and not value.dtype.is_complex:
        return ""
    bad = ~torch.isfinite(value)
    if not bool(bad.any()):
        return ""
    from _quantplug.observers.nonfinite import nonfinite_counts

    _, _, counts = nonfinite_counts(value, ~bad)
    first = tuple(int(i) for i in bad.nonzero()[0].tolist())
    return f"{counts} value(s), the first at index {first}"


def nonfinite_input_error(
    exc: NonFiniteError,
    index: int,
    origin: str,
    batch: Call,
    inputs: Sequence[InputSpec],
    program: torch.export.ExportedProgram,
) -> InputError:
    """The observer's NaN/inf error, with the batch, its file and the inputs that held them."""
    where = f"calibration batch {index} ({origin})"
    try:
        flat = _flat_inputs(batch, in_spec_of(program), where)
    except InputError:
        flat = []
    held = [
        f"input {spec.name!r} holds {text}"
        for value, spec in zip(flat, inputs)
        if isinstance(value, torch.Tensor) and (text := _nonfinite_text(value))
    ]
    source = "; ".join(held) if held else "its inputs are finite: the model computes them"
    return InputError(
        f"{where}: NaN/inf values reached {exc.reached} ({source}); fix the data or the "
        "model, or pass --nonfinite ignore to leave them out of the calibration statistics"
    )


def random_batches(program: torch.export.ExportedProgram, count: int) -> list[Call]:
    from _quantplug.flow.inspect import example_inputs

    gm = program.module()
    try:
        flat = [example_inputs(gm, seed=i) for i in range(count)]
    except ValueError as exc:
        raise InputError(f"cannot make random calibration data: {exc}; pass --calibration") from exc
    return [unflatten(list(values), in_spec_of(program)) for values in flat]
