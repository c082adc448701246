"""Pipeline schedules as per-rank action tables over model chunks (1F1B, GPipe, serial, encoder placement)."""

from pipetune.schedule.schedules import Schedule, gpipe, one_f_one_b, onto_ranks, place_encoders, serial
from pipetune.schedule.table import Action, ChunkStyle, Module, Op, Placement, ScheduleError, ScheduleTable

__all__ = ["Action", "ChunkStyle", "Module", "Op", "Placement", "Schedule", "ScheduleError", "ScheduleTable", "gpipe", "one_f_one_b",
           "onto_ranks", "place_encoders", "serial"]
