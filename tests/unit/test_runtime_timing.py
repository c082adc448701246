"""Action timelines in the simulator's semantics, on a fake host clock (deterministic)."""

import pytest
import torch

import torchtitan_patches.runtime.timing as timing


class FakeClock:
    def __init__(self, now: float):
        self.now = now

    def __call__(self):
        return self.now


@pytest.mark.parametrize("origin", [100.0, 100.0 + 5 * 3600.0])
def test_waiting_pushes_the_next_start_back_and_bookkeeping_is_charged_to_the_action(monkeypatch, origin):
    """Times are from the step's start on the rank's own clock: a clock hours off (another node)
    gives the same timeline."""
    clock = FakeClock(origin)
    monkeypatch.setattr(timing.time, "perf_counter", clock)
    tl = timing.Clock(torch.device("cpu")).timeline()
    tl.start()
    tl.begin()
    clock.now += 2.0  # first action's work
    tl.end()
    clock.now += 0.5  # posting messages
    with tl.waiting():
        clock.now += 3.0  # blocked on a receive: idle
    clock.now += 0.25
    tl.begin()
    clock.now += 1.0
    tl.end()
    clock.now += 0.125  # waiting for sends at the end of the step
    spans, end = tl.finish()
    # the second action starts when the rank was free (first end + 3 s idle) and takes the
    # bookkeeping around the wait (0.5 + 0.25 s) plus its 1 s of work
    assert spans == [(0.0, 2.0), (5.0, 6.75)]
    assert end == 6.875
