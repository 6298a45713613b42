"""Qualcomm chipsets and their HTP generation (ExecuTorch 1.5.1 ``qc_schema._soc_info_table``).

The HTP architecture decides what the quantizer may emit (LPBQ needs V69+, 16-bit activations
with 16-bit weights need V73+); VTCM size is informational (it only matters to the compiler).
"""

from __future__ import annotations

from dataclasses import dataclass

from quantplug.backend import OptionError

V68, V69, V73, V75, V79, V81 = 68, 69, 73, 75, 79, 81


@dataclass(frozen=True)
class SocInfo:
    """One chipset: its name, ExecuTorch ``QcomChipset`` id, HTP arch, VTCM and LPAI version."""

    name: str
    chipset_id: int
    htp_arch: int
    vtcm_mb: int
    lpai_version: int | None = None

    @property
    def arch_name(self) -> str:
        return f"V{self.htp_arch}"


SOC_TABLE: dict[str, SocInfo] = {
    s.name: s
    for s in (
        SocInfo("SA8295", 39, V68, 8),
        SocInfo("SA8797", 72, V81, 16),
        SocInfo("SC8380XP", 60, V73, 8),
        SocInfo("SM8350", 30, V68, 4),
        SocInfo("SM8450", 36, V69, 8),
        SocInfo("SM8475", 42, V69, 8),
        SocInfo("SM8550", 43, V73, 8),
        SocInfo("SA8255", 52, V73, 8),
        SocInfo("SM8650", 57, V75, 8),
        SocInfo("SM8750", 69, V79, 8),
        SocInfo("SM8850", 87, V81, 8, lpai_version=6),
        SocInfo("SSG2115P", 46, V73, 2),
        SocInfo("SSG2125P", 58, V73, 2),
        SocInfo("SXR1230P", 45, V73, 2),
        SocInfo("SXR2230P", 53, V69, 8),
        SocInfo("SXR2330P", 75, V79, 8),
        SocInfo("QCS9100", 77, V73, 8),
        SocInfo("SAR2230P", 95, V81, 4, lpai_version=6),
        SocInfo("SW6100", 96, V81, 4),
        SocInfo("QCM6490", 93, V68, 2),
        SocInfo("SM8845", 97, V81, 8),
    )
}

#: ExecuTorch's default chipset.
DEFAULT_SOC = "SM8750"
SOC_NAMES: tuple[str, ...] = tuple(SOC_TABLE)


def lookup(soc_model: str | None) -> SocInfo:
    """The chipset named ``soc_model`` (case-insensitive), or ``OptionError`` listing valid names."""
    if soc_model is None:
        return SOC_TABLE[DEFAULT_SOC]
    info = SOC_TABLE.get(str(soc_model).upper())
    if info is None:
        raise OptionError(f"unknown QNN HTP soc_model {soc_model!r}; valid values: {', '.join(SOC_NAMES)}")
    return info
