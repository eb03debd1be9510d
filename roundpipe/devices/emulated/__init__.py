"""The emulated backend: N virtual devices on the CPU, never kinder than a GPU."""

from .device import EmulatedDevice, EmulatedDevicePool, EmulatedOptions

__all__ = ["EmulatedDevice", "EmulatedDevicePool", "EmulatedOptions"]
