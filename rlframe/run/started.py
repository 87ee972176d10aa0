"""What a run has started, recorded part by part as each comes to exist, and torn down in
order (:class:`Started`): shared by the launcher and the loop's assembly, and light to import
(the launcher holds one before Ray starts)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from rlframe.controller.cluster import RayStart
    from rlframe.observability.logs import DriverLogs
    from rlframe.observability.tracking import Tracker
    from rlframe.rollout import Producer
    from rlframe.run.pools import Launch


@dataclass
class Started:
    """What the run has started so far, each part recorded as soon as it exists, so that a
    failure half-way still stops it. :meth:`close` is the run's teardown, in its order: the
    experience producer, the tracker, the worker groups and pools, Ray, the log files."""

    logs: DriverLogs
    ray: RayStart | None = None
    launch: Launch | None = None
    tracker: Tracker | None = None
    experience: Producer | None = None

    def close(self) -> None:
        if self.experience is not None:
            self.experience.close()
        if self.tracker is not None:
            self.tracker.close()
        if self.launch is not None:
            self.launch.shutdown()
        if self.ray is not None:
            self.ray.stop()
        self.logs.close()
