"""Pipeline schedules as per-rank action tables (1F1B, GPipe) and encoder placement."""

from pipetune.schedule.schedules import SCHEDULES, gpipe, one_f_one_b, place_encoders
from pipetune.schedule.table import Action, Op, ScheduleError, ScheduleTable

__all__ = ["SCHEDULES", "Action", "Op", "ScheduleError", "ScheduleTable", "gpipe", "one_f_one_b", "place_encoders"]
