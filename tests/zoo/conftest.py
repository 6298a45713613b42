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


@pytest.fixture(scope="module")
def zoo(request: pytest.FixtureRequest) -> Iterator[harness.FloatCase]:
    name = request.param
    model = MODELS[name]
    if not model.available():
        pytest.skip(f"{model.needs} is not installed (scripts/setup.sh --test installs it)")
    yield harness.float_case(name)
    harness.forget()
