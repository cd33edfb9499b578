"""Architecture specs: families as data (see ``families/*.yaml``)."""

from symfuse.arch.registry import all_specs, get_spec, supported_model_types
from symfuse.arch.spec import ArchSpec, Geometry, ModuleRef, ModuleWeights

__all__ = ["ArchSpec", "Geometry", "ModuleRef", "ModuleWeights", "all_specs", "get_spec", "supported_model_types"]
