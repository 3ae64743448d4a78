"""Tracing routes from an unmodified ``nn.Module`` to the autopipe graph."""
from .trace import ROUTES, TracedModel, trace

__all__ = ["trace", "TracedModel", "ROUTES"]
