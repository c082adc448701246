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


def test_a_gpu_region_is_queued_behind_a_sleep_that_grows_until_it_covers_the_launches(monkeypatch):
    """On CUDA, ``Clock.measure`` puts a sleep kernel before the region's start event (so the
    events time queued kernels, not their launches) and doubles it, up to its cap, after a region
    whose start the device had already passed when the host finished queueing it, per region key."""
    calls, passed = [], iter([True, True, False] + [True] * 40)

    class Event:
        def __init__(self, enable_timing):
            pass

        def record(self):
            calls.append("record")

        def query(self):
            return next(passed)

        def synchronize(self):
            pass

        def elapsed_time(self, other):
            return 2.0

    monkeypatch.setattr(torch.cuda, "_sleep", lambda cycles: calls.append(cycles))
    monkeypatch.setattr(torch.cuda, "Event", Event)
    clock = timing.Clock(torch.device("cuda"))
    first, top = timing.QUEUE_AHEAD_CYCLES
    out, seconds = clock.measure(lambda: calls.append("fn") or 7)
    assert (out, seconds) == (7, 0.002) and calls == [first, "record", "fn", "record"]
    sleeps = [first]
    for _ in range(25):
        calls.clear()
        clock.measure(lambda: None)
        sleeps.append(calls[0])
    assert sleeps[:4] == [first, 2 * first, 4 * first, 4 * first]  # the third region was queued in time
    assert max(sleeps) == top and sleeps[-1] == top
    passed = iter([False] * 3)
    for key in ("embedding", "embedding", None):  # another region starts from the shortest sleep; each keeps its own
        calls.clear()
        clock.measure(lambda: None, key)
        sleeps.append(calls[0])
    assert sleeps[-3:] == [first, first, top]
