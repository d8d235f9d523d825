from __future__ import annotations

from router.pool import Breaker


def test_breaker_opens_half_opens_for_one_trial_and_closes() -> None:
    breaker = Breaker(threshold=3, reset=5.0)
    for _ in range(2):
        breaker.failure(now=0.0)
    assert breaker.allows(1.0) and breaker.state == "closed"
    breaker.failure(now=1.0)
    assert breaker.state == "open" and not breaker.allows(5.9)
    assert breaker.allows(6.0)  # reset elapsed: one trial may go
    breaker.begin()
    assert breaker.state == "half_open" and not breaker.allows(6.1)
    breaker.failure(now=6.2)  # the trial failed: open for another period
    assert not breaker.allows(11.0) and breaker.allows(11.3)
    breaker.begin()
    breaker.success()
    assert breaker.state == "closed" and breaker.allows(11.4) and breaker.failures == 0
