"""Construction, once per wrap call: from a module and the options of one call to built units.

Imported by the front ends (fsdp.py, fsdp2/) and flatshard.testing only; nothing of the step (hooks,
schedule, unit) imports it back (tests/test_layering.py holds both).

  units.py        the pipeline every front end shares: build_units, build_unit, become_root
  build/placement.py    which unit owns which parameter (shared and tied parameters)
  build/grouping.py     a unit's parameters split into flat groups: by mesh, then by dtype
  build/deferred.py     meta-device models: materialised unit by unit, or left to the user (fully_shard)
  build/autoshard.py    sharding_factor="auto": the planner asked for F
  build/fingerprint.py  every rank wraps the same model with the same options
  build/optim_check.py  optimizers built on shard views are what they seem
"""

from flatshard.runtime.build.units import (
    BuildOptions,
    Built,
    MakeHost,
    become_root,
    build_unit,
    build_units,
    schedule_config,
)

__all__ = ["BuildOptions", "Built", "MakeHost", "become_root", "build_unit", "build_units", "schedule_config"]
