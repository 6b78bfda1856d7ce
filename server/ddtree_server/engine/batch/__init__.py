"""The batch engine: continuous batching of plain, DFlash and DDTree requests (docs/architecture.md)."""

from ddtree_server.engine.batch.engine import BatchEngine, SlotMemory, StepInfo
from ddtree_server.engine.batch.request import GenerationEvent, Request

__all__ = ["BatchEngine", "GenerationEvent", "Request", "SlotMemory", "StepInfo"]
