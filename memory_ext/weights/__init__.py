"""Remappable weights: decoder layers' parameters in pool chunks (``store``), streamed back
from a host master copy just before they run (``pipeline``), copied asynchronously
(``copier``). Mechanisms only: which layers stream is a policy's choice
(``memory_ext.policy.oneiros`` / ``select_n``). See docs/weights.md.
"""

from .copier import CudaCopier, HostCopier, Ticket
from .pipeline import LayerPipeline
from .store import NotResident, WeightStore

__all__ = ["CudaCopier", "HostCopier", "LayerPipeline", "NotResident", "Ticket", "WeightStore"]
