"""What the async run tests share: the two placements on 2 CPUs."""

from __future__ import annotations

PLACEMENTS = {
    "colocated": ["trainer.cpus_per_proc=2"],
    "separate": [
        "rollout.placement=separate",
        "trainer.cpus_per_proc=1",
        "rollout.cpus_per_proc=1",
        "ray.num_cpus=2",
    ],
}
