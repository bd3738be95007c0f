"""Calibration: profile files and the performance models built from them (LLM-Mesh 5.2).

- `calibration.profile`: the "mesh-profile/1" file format, validation, packaged references.
- `calibration.perf_model`: prefill and decode iteration times interpolated from a profile.
- `calibration.roofline`: the roofline model behind the packaged reference profiles.
"""
from calibration.perf_model import PerformanceModel
from calibration.profile import (
    Profile,
    ProfileError,
    load_profile,
    profile_from_dict,
    profile_to_dict,
    reference_profile,
    reference_profiles,
    save_profile,
)

__all__ = [
    "PerformanceModel",
    "Profile",
    "ProfileError",
    "load_profile",
    "profile_from_dict",
    "profile_to_dict",
    "reference_profile",
    "reference_profiles",
    "save_profile",
]
