"""Record what an ``LLMEngine``'s scheduler hands out, step by step."""

from __future__ import annotations


def record_schedules(engine) -> list:
    """Wrap ``engine.scheduler.schedule`` (an ``LLMEngine``'s) so that every
    ``SchedulerOutput`` it returns is also appended to the returned list."""
    outputs = []
    schedule = engine.scheduler.schedule

    def wrapped():
        out = schedule()
        outputs.append(out)
        return out

    engine.scheduler.schedule = wrapped
    return outputs
