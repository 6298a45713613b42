# Native kernels built from _histogram_kernels.c (optional; see _quantplug.observers.kernels).

def minmax(address: int, n: int, /) -> tuple[float, float]: ...
def bin_counts(
    address: int,
    n: int,
    lo: float,
    scale: float,
    divisor: float,
    bins: int,
    out_address: int,
    accumulate: bool,
    /,
) -> None: ...
def rebin(
    hist_address: int,
    bins: int,
    rate: int,
    mids_address: int,
    edges_address: int,
    base_address: int,
    out_address: int,
    /,
) -> bool: ...
