"""Calibration over several processes (public front: :mod:`quantplug.distributed`)."""
