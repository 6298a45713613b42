"""``python -m quantplug``: the ``quantplug`` command (``torchrun ... -m quantplug quantize ...``)."""

from _quantplug.cli.main import run_module

if __name__ == "__main__":
    run_module()
