"""quantplug's reference CPU backend (``quantplug.get_quantizer("reference")``)."""
