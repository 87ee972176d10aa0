"""The frozen models a run serves (teachers; judges), as the launcher starts them."""

from __future__ import annotations

from dataclasses import dataclass

from rlframe.config.placement import PoolShape
from rlframe.config.schema import Config
from rlframe.config.served import ServedModelConfig, ServedPlacement


@dataclass(frozen=True)
class ServedSpec:
    """One frozen model the run serves."""

    name: str
    """Its name in metrics and errors (``teacher``, ``teacher/math``, ``judge``)."""
    path: str
    """Its folder, hub id or tiny-model id, as configured."""
    section: str
    """The config section that asked for it (its serving keys' prefix)."""
    key: str
    """The key that holds ``path`` (named in errors)."""
    serving: ServedModelConfig

    @property
    def pool(self) -> PoolShape | None:
        """Its own pool's shape (placement=separate), or None on the trainer's bundles."""
        s = self.serving
        if s.placement is ServedPlacement.colocated:
            return None
        return PoolShape(self.section, s.nnodes, s.procs_per_node, s.cpus_per_proc)


def list_served_models(cfg: Config) -> list[ServedSpec]:
    """Every frozen model the config serves: the teachers of ``distill``, the judge of
    ``reward.judge``."""
    d = cfg.distill
    specs = [ServedSpec("teacher", d.teacher, "distill", "distill.teacher", d)] if d.teacher else []
    specs += [
        ServedSpec(f"teacher/{k}", path, "distill", f"distill.teachers.{k}", d)
        for k, path in d.teachers.items()
    ]
    judge = cfg.reward.judge
    if judge.path is not None:
        specs.append(ServedSpec("judge", judge.path, "reward.judge", "reward.judge.path", judge))
    return specs
