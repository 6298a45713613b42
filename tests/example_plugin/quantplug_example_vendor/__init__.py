"""quantplug-example-vendor: an example backend (``example_vendor``) and a ``reference`` extension.

This file stays empty on purpose: the core imports ``quantplug_example_vendor.plugin`` when a
user asks for ``example_vendor`` and ``quantplug_example_vendor.reference_ext`` when a user asks
for ``reference``; importing the package itself must not pull in either.
"""
