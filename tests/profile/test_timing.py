"""The profile's timings are CPU time of the timing thread: time the core spends on other jobs (here
stood in for by sleeping, which takes no CPU) does not enter the op table."""

import time

from hybridpar.profile.timing import measure


def test_time_off_the_core_is_not_counted():
    def work_then_wait() -> None:
        sum(range(20_000))  # ~0.2-1 ms of CPU
        time.sleep(0.02)  # 20 ms off the core: what a loaded machine's run queue looks like to a thread

    m = measure(work_then_wait, warmup=1, repeats=5)
    assert 0 < m.median_s < 0.01
    busy = measure(lambda: sum(range(400_000)), warmup=1, repeats=5)
    assert busy.median_s > 2 * m.median_s  # CPU work is counted
