"""Performance: profile files and every iteration-time model (LLM-Mesh 5.2).

Below the engines and above the policy core: the simulated engine, the runtime and the
agents predict iterations with these, and the calibration runs (calibration/) write them.

- `mesh.perf.profile`: the "mesh-profile" file format, validation, packaged references
  (`profiles/`).
- `mesh.perf.model`: prefill and decode iteration times interpolated from a profile.
- `mesh.perf.roofline`: the roofline model behind the packaged reference profiles.
- `mesh.perf.times`: a model's times before it is calibrated (`DefaultCpuTimes`, prior
  profiles) and corrected by the iterations a node really sees (`AdaptiveTimes`).

The interface the policy core predicts with (`IterationTimes`, `extra_s`) is
mesh.policy.batching.
"""
from mesh.perf.model import PerformanceModel
from mesh.perf.profile import (
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
