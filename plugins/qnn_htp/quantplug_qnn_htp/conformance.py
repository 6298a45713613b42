"""What ``quantplug conformance qnn_htp`` may expect of this backend: its artifact files.

Every op meets the kit's default SQNR floor (``stack`` and the accumulating scatters used to
need lower floors while they followed ExecuTorch's sharing, which clips: see
``rules/concat_rules.py``).
"""

from __future__ import annotations

from quantplug.backend import ConformanceProfile

PROFILE = ConformanceProfile(artifact_files=("model.onnx", "model.encodings"))
