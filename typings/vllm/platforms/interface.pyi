from typing import NamedTuple

class DeviceCapability(NamedTuple):
    major: int
    minor: int

class Platform:
    device_name: str
    device_type: str
    def is_sleep_mode_available(self) -> bool: ...
    @classmethod
    def get_device_capability(cls, device_id: int = 0) -> DeviceCapability | None: ...
