# Native kernels built from _histogram_kernels.c (optional; see _quantplug.observers.kernels).

def minmax(address: int, n: int, /) -> tuple[float, float]: ...
def minmax_rows(address: int, n: int, rows: int, stride: int, /) -> tuple[float, float]: ...
def record_range(
    lo: float, hi: float, average: bool, c: float, min_address: int, max_address: int, batches_address: int, /
) -> None: ...
def bin_counts(
    address: int,
    n: int,
    lo: float,
    scale: float,
    divisor: float,
    bins: int,
    out_address: int,
    accumulate: bool,
    min: float = ...,
    max: float = ...,
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
def observe(
    address: int,
    n: int,
    rows: int,
    stride: int,
    lo: float,
    hi: float,
    scale: float,
    divisor: float,
    bins: int,
    hist_address: int,
    min_address: int,
    max_address: int,
    batches_address: int,
    /,
) -> tuple[float, float] | None: ...
def start(
    address: int,
    n: int,
    bins: int,
    floor: float,
    hist_address: int,
    min_address: int,
    max_address: int,
    batches_address: int,
    /,
) -> tuple[float, float, float, float, int] | tuple[float, float]: ...
def row_extremes(address: int, rows: int, cols: int, min_address: int, max_address: int, /) -> bool: ...
def quantize_rows(
    address: int,
    rows: int,
    cols: int,
    inv_address: int,
    inv_step: int,
    zp_address: int,
    zp_step: int,
    lo: int,
    hi: int,
    out_address: int,
    unsigned: bool,
    /,
) -> bool: ...
def fake_quantize(
    address: int, n: int, inv: float, scale: float, zero_point: int, lo: int, hi: int, out_address: int, /
) -> bool: ...
def quantization_errors(
    address: int,
    rows: int,
    cols: int,
    scale_address: int,
    scale_step: int,
    lo: int,
    hi: int,
    out_address: int,
    double: bool,
    /,
) -> None: ...
def search_norms(
    bins: int,
    rows: int,
    density_address: int,
    owner_address: int,
    start_address: int,
    width_address: int,
    dst_address: int,
    half_address: int,
    half_cubed_address: int,
    whole_bin_address: int,
    top: int,
    out_address: int,
    /,
) -> None: ...
def _use_avx2(flag: bool, /) -> bool: ...
def search_walk(
    c_sum_address: int,
    bins: int,
    total: float,
    alpha: float,
    beta: float,
    start_bin: int,
    end_bin: int,
    n: int,
    max_steps: int,
    /,
) -> list[tuple[float, float, int, int]]: ...
