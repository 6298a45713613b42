"""The example vendor's annotation rules: the backend's modules, and ``abs_rules`` for its
extension of ``reference``.

Each module declares the ops it covers in its ``@register_annotator`` decorators, and nowhere
else: ``rules.json`` here indexes them (``quantplug metadata example_vendor`` writes it), so that
the core learns which module covers which op without importing any of them; it imports a rules
module only when the graph being annotated contains one of its ops.
"""
