"""The PT2E tests run torchao's QAT flows side by side: its pattern graphs are exported once per
session (tests/torchao_patterns.py says why and how)."""

from __future__ import annotations

from tests.torchao_patterns import install

install()
