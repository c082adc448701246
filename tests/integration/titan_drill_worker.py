"""One rank of a TorchTitan job (``torchtitan.train``'s entry point) for the resume drills
(tests/integration/test_titan_resume.py). With ``KILL_AT_SAVE=rank:step`` in the environment,
that rank writes its share of the step-``step`` checkpoint and is killed (SIGKILL, as by an OOM
killer) before the write returns: the checkpoint is left half-written."""

import os
import signal

from torch.distributed.checkpoint import FileSystemWriter
from torchtitan.train import main


def _kill_at_save(rank: int, step: int) -> None:
    write = FileSystemWriter.write_data

    def write_data(self, plan, planner):
        done = write(self, plan, planner)
        if os.path.basename(str(self.path)) == f"step-{step}" and int(os.environ["RANK"]) == rank:
            done.wait()
            os.kill(os.getpid(), signal.SIGKILL)
        return done

    FileSystemWriter.write_data = write_data


if __name__ == "__main__":
    if "KILL_AT_SAVE" in os.environ:
        _kill_at_save(*map(int, os.environ["KILL_AT_SAVE"].split(":")))
    main()
