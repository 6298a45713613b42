"""``python -m bench``: prepare/convert/calibration/forward timings, quantplug vs torchao."""

from bench.run import main

if __name__ == "__main__":
    raise SystemExit(main())
