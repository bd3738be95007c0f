"""What a node agent learns about its machine, kept per node, not
per instance, so it outlives the instances that learnt it.

- `speed`: the probe run when the agent starts (mesh.node.speed_probe), against the
  machine the prior was fitted on: the prior's factors for a model this node never ran.
- `times`: per model, the AdaptiveTimes of its newest instance here. A model's next
  instance starts from them (AdaptiveTimes.warm_start); a model new to the node starts from
  what prior-based instances of other models learnt here (the prior scales every model by
  weight size from one fit, so how far off it is on this machine carries over), else from
  the probe.
`view()` is what the agent's stats carry and `GET /admin/learnt` exports for the twin. (Cold
starts are measured by the service, per node, model and source: mesh.perf.load_times.ColdStartTable.)
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

from mesh.perf.speed import MachineSpeed, SpeedFactors
from mesh.perf.times import AdaptiveTimes, DefaultCpuTimes, weighted_geomean


@dataclass
class NodeLearning:
    speed: MachineSpeed | None = None
    factors: SpeedFactors = SpeedFactors()
    times: dict[str, AdaptiveTimes] = field(default_factory=dict)  # model -> its newest instance's times

    def set_speed(self, speed: MachineSpeed) -> None:
        self.speed, self.factors = speed, SpeedFactors.against(speed)

    def start_for(self, model: str) -> tuple[float, float]:
        """(prefill, decode) factors a new prior-based instance of a model new here starts
        from: the observation-weighted geometric mean of what this node's prior-based
        instances learnt once they have a margin (a few dozen iterations), else the probe's."""
        learnt = [(t.observed, t.prefill_factor, t.decode_factor) for m, t in self.times.items()
                  if m != model and isinstance(t.base, DefaultCpuTimes) and t.margin is not None]
        if not learnt:
            return self.factors.prefill, self.factors.decode
        prefill = weighted_geomean([(n, p) for n, p, _ in learnt])
        decode = weighted_geomean([(n, d) for n, _, d in learnt])
        if prefill is None or decode is None:  # nothing observed yet
            return self.factors.prefill, self.factors.decode
        return prefill, decode

    def adopt(self, model: str, times: AdaptiveTimes) -> AdaptiveTimes:
        """A new instance's times, warm-started from this node's learning, kept as the model's."""
        earlier = self.times.get(model)
        if earlier is not None and type(earlier.base) is type(times.base):
            times.warm_start(earlier)
        elif isinstance(times.base, DefaultCpuTimes):
            prefill, decode = self.start_for(model)
            times.prefill_factor, times.decode_factor = times._clamp(prefill), times._clamp(decode)
            times.start = (times._clamp(self.factors.prefill),
                           times._clamp(self.factors.decode))  # relax(): the probe's
        self.times[model] = times
        return times

    def forget(self, model: str) -> None:
        """A deleted model's learnt times go."""
        self.times.pop(model, None)

    def view(self) -> dict[str, Any]:
        return {"speed": None if self.speed is None else self.speed.to_dict(), "speed_factors": self.factors.to_dict(),
                "cores": sorted(os.sched_getaffinity(0)),  # what the factors describe: the node's core set
                "models": {m: {"base": "prior" if isinstance(t.base, DefaultCpuTimes) else "profile",
                               "time_factors": t.drift()} for m, t in self.times.items()}}
