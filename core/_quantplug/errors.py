"""The exceptions quantplug raises.

Every error a user can trigger is one of these, so callers can catch ``QuantplugError`` and
scripts can tell a bad option from a calibration mistake without parsing messages. Messages
name the node, op, option or plugin at fault and say how to fix it.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

from _quantplug.suggest import did_you_mean

if TYPE_CHECKING:
    from _quantplug.validation.report import ValidationReport


class QuantplugError(Exception):
    """Base class of every error raised by quantplug."""


class UnknownBackendError(QuantplugError, LookupError):
    """A backend name that no installed distribution provides."""

    def __init__(self, name: str, installed: Iterable[str]) -> None:
        self.name = name
        self.installed = sorted(installed)
        listed = ", ".join(self.installed) if self.installed else "none"
        super().__init__(
            f"unknown backend {name!r}{did_you_mean(name, self.installed)}; installed backends: {listed}. "
            "Install the plugin distribution that provides it (e.g. `pip install quantplug-<name>`)."
        )


class BackendLoadError(QuantplugError, ImportError):
    """A backend (or extension) plugin that is installed but cannot be imported or used.

    ``extension_of`` is set when the module at fault is an extension loaded with backend
    ``name``: the backend it is registered for, or ``"*"`` when every backend loads it (then
    none can load, and the message says so).
    """

    def __init__(
        self,
        name: str,
        distribution: str | None,
        module: str,
        cause: BaseException | str,
        *,
        extension_of: str | None = None,
    ) -> None:
        dist = f" from distribution {distribution!r}" if distribution else ""
        reason = f"{type(cause).__name__}: {cause}" if isinstance(cause, BaseException) else cause
        fix = f"fix, upgrade or uninstall {distribution!r}" if distribution else "fix or remove it"
        if extension_of == "*":
            message = (
                f"backend {name!r} cannot load: extension {module!r}{dist}, registered for every backend "
                f"('*'), failed to load: {reason}. Every backend loads it, so none can be used until "
                f"it is fixed: {fix}."
            )
        elif extension_of is not None:
            message = (
                f"backend {name!r} cannot load: its extension {module!r}{dist} failed to load: {reason}. "
                f"Other backends are unaffected; {fix}."
            )
        else:
            message = (
                f"backend {name!r}{dist} failed to load (module {module!r}): {reason}. "
                "Other backends are unaffected; reinstall or upgrade that plugin."
            )
        super().__init__(message)
        # set after ImportError.__init__, which resets ``name`` to None
        self.name = name
        self.distribution = distribution
        self.module = module
        self.cause = cause
        self.extension_of = extension_of


class BackendFailedError(BackendLoadError):
    """A backend that loaded, but whose code (a rule, an annotation stage, a fusion condition)
    raised while it ran: a defect of that plugin, not of the user's model or options.

    A :class:`BackendLoadError`, so code catching that keeps working (before 0.2.0 these failures
    were raised as one, saying the backend "failed to load")."""

    def __init__(
        self, name: str, distribution: str | None, module: str, what: str, cause: BaseException
    ) -> None:
        super().__init__(name, distribution, module, cause)
        self.what = what
        dist = f" from distribution {distribution!r}" if distribution else ""
        message = (
            f"backend {name!r}{dist} failed in {what} (module {module!r}): {type(cause).__name__}: {cause}. "
            "This is a defect of that plugin: report it to its authors (other backends are unaffected)."
        )
        self.args = (message,)
        self.msg = message  # what ImportError's str() shows


class DuplicateBackendError(QuantplugError):
    """Two installed distributions claim the same backend name."""

    def __init__(self, name: str, claimants: Iterable[str]) -> None:
        self.name = name
        self.claimants = sorted(claimants)
        super().__init__(
            f"backend name {name!r} is claimed by several distributions: {', '.join(self.claimants)}. "
            "Uninstall all but one of them."
        )


class BackendDisabledError(QuantplugError):
    """A backend that exists but is switched off by QUANTPLUG_BACKENDS / QUANTPLUG_DISABLE_PLUGIN_AUTOLOAD."""


class OptionError(QuantplugError, ValueError):
    """A backend option that is unknown, of the wrong type or outside its choices."""


class AnnotationError(QuantplugError, ValueError):
    """Annotations that cannot be turned into observers (bad sharing, missing sources, ...)."""


class TensorKwargError(AnnotationError, AssertionError):
    """An annotated node takes a tensor as a keyword argument (``out=``, a traced ``max=``):
    PT2E places observers on positional inputs only, so that tensor would stay unquantized
    without a word. An ``AssertionError`` too, as torchao's ``prepare_pt2e`` raises there."""


class CalibrationError(QuantplugError, RuntimeError):
    """convert() was asked for qparams an observer cannot give (it never saw data)."""


class NonFiniteError(CalibrationError):
    """NaN or infinite values reached an observer (or a weight) that measures a range from them,
    or a layer input an accuracy algorithm collects statistics from.

    ``where`` names the node(s) whose observer saw them (the weight, for an algorithm's layer);
    ``reached`` says what they reached, in words; ``nan`` and ``inf`` count what that tensor held.
    The command line adds the calibration file, batch and input.
    """

    def __init__(
        self, message: str, *, where: str = "", nan: int = 0, inf: int = 0, reached: str = ""
    ) -> None:
        super().__init__(message)
        self.where = where
        self.nan = nan
        self.inf = inf
        self.reached = reached or f"the observer of {where}"


class ObserverMergeError(CalibrationError):
    """Observer statistics that cannot be combined (different kinds, grids or shapes)."""


class DistributedError(QuantplugError, RuntimeError):
    """Processes of a ``torch.distributed`` group that disagree (different prepared programs) or
    that did not all reach a synchronisation point in time."""


class CollectorMergeError(DistributedError):
    """An algorithm's collector that cannot combine the statistics of several processes (it
    defines no ``state()``/``merge_(states)``), or whose states do not merge."""


class UnsafeArchiveError(QuantplugError, ValueError):
    """A ``.pt2`` archive that would run code when loaded (pickled entries, code in names), or
    that cannot be checked: damaged, ambiguous (torch's zip reader and Python's would read
    different entries), or holding entries outside torch.export.save's layout or too large."""


class ConversionError(QuantplugError, RuntimeError):
    """A prepared model that convert() cannot turn into a quantized program."""


class LoweringError(QuantplugError, RuntimeError):
    """A backend's lowering passes or artifact writer failed on a quantized program."""


class ConstraintViolationError(QuantplugError, ValueError):
    """Strict validation found annotations the target hardware cannot run."""

    def __init__(self, report: ValidationReport) -> None:
        self.report = report
        super().__init__(
            f"{len(report.violations)} quantization constraint violation(s):\n{report.format()}\n"
            "Change the offending configs (or pass strict=False to only warn)."
        )


class UnknownAlgorithmError(QuantplugError, LookupError):
    """An algorithm name that neither an installed distribution nor an in-process registration provides."""

    def __init__(self, name: str, installed: Iterable[str]) -> None:
        self.name = name
        self.installed = sorted(installed)
        listed = ", ".join(self.installed) if self.installed else "none"
        super().__init__(
            f"unknown algorithm {name!r}{did_you_mean(name, self.installed)}; "
            f"installed algorithms: {listed}. "
            "`quantplug algorithms` lists them; third-party ones install through the "
            "'quantplug.algorithms' entry-point group."
        )


class AlgorithmError(QuantplugError, ValueError):
    """An algorithm that fails to load, or whose choice leaves the backend's grid or contract."""
