"""The backend conformance kit (public front: :mod:`quantplug.conformance`)."""
