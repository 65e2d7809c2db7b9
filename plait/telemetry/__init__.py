"""Phase timers and metric sinks (console via rich, JSONL in the run directory)."""

from plait.telemetry.sinks import MetricsSink
from plait.telemetry.timers import PhaseTimer


__all__ = ["PhaseTimer", "MetricsSink"]
