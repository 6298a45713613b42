"""The zoo's shared state: one exported model at a time, its results cached across tests.

Every zoo test takes the ``zoo`` fixture, parametrized by model name at module scope, so pytest
runs all tests of one model together; the model's exported program, float outputs and converted
programs are computed once and dropped when pytest moves to the next model (memory stays that
of one model).
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.zoo import harness
from tests.zoo.models import MODELS


@pytest.hookimpl(trylast=True)  # after pytest's own reordering by parameter
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Run every test of one zoo model together, in the order of ``MODELS``.

    pytest groups tests by all their module-scoped parameters (model, backend, preset), which
    interleaves models (resnet18's int8 cases, then mobilenet_v2's...), and the ``zoo`` fixture
    would rebuild, export and calibrate each model many times over. A stable sort of the zoo's
    items by model keeps everything else where pytest put it.
    """
    order = {name: i for i, name in enumerate(MODELS)}

    def model_of(item: pytest.Item) -> int | None:
        callspec = getattr(item, "callspec", None)
        name = callspec.params.get("zoo") if callspec is not None else None
        return order.get(name) if isinstance(name, str) else None

    positions = [i for i, item in enumerate(items) if model_of(item) is not None]
    ranked = sorted((items[i] for i in positions), key=lambda item: model_of(item) or 0)
    for i, item in zip(positions, ranked):
        items[i] = item


@pytest.fixture(scope="module")
def zoo(request: pytest.FixtureRequest) -> Iterator[harness.FloatCase]:
    name = request.param
    model = MODELS[name]
    if not model.available():
        pytest.skip(f"{model.needs} is not installed (scripts/setup.sh --test installs it)")
    yield harness.float_case(name)
    harness.forget()
