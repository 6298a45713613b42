"""The numeric debugger (public front: :mod:`quantplug.debug`)."""
