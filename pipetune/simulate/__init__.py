"""The DAG pipeline simulator: timing, memory, lower bounds and pictures of schedule tables."""

from pipetune.simulate.dag import CompiledSchedule, compile_schedule
from pipetune.simulate.simulator import BatchResult, Latencies, SimResult, TimedAction, evaluate, simulate

__all__ = ["BatchResult", "CompiledSchedule", "Latencies", "SimResult", "TimedAction", "compile_schedule", "evaluate", "simulate"]
