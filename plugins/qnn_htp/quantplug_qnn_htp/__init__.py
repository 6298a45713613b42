"""quantplug backend for Qualcomm QNN HTP (entry point ``qnn_htp`` in ``quantplug.backends``).

Importing this package imports nothing heavy: the hooks live in ``quantplug_qnn_htp.plugin`` and
the annotation rules in ``quantplug_qnn_htp.rules.*_rules`` modules the core loads on demand.
"""

__version__ = "0.1.0"
