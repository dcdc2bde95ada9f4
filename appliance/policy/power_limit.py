"""The static power limit (``thermal.power_limit_w``) a card is given: pure, a table test.

The card says what it allows (NVML's ``nvmlDeviceGetPowerManagementLimitConstraints``,
in mW); a limit outside that range is refused by the driver, so the appliance sets the
nearest allowed one instead and says so.
"""

from __future__ import annotations


def clamp_limit_mw(wanted_w: int, min_mw: int, max_mw: int) -> tuple[int, str]:
    """The limit to set (mW) for ``wanted_w`` watts on a card allowing ``min_mw..max_mw``,
    and a note when it was clamped ("" otherwise). A range upside down (a driver quirk)
    is read from its maximum: never more than the card allows."""
    wanted = wanted_w * 1000
    low, high = min(min_mw, max_mw), max_mw
    if wanted < low:
        return low, f"raised to the card's minimum {low / 1000:g} W"
    if wanted > high:
        return high, f"lowered to the card's maximum {high / 1000:g} W"
    return wanted, ""
