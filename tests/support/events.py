"""``JobEvents`` for stage tests: remembers each finished job by id."""

from __future__ import annotations

from s2s_daemon.pipeline.jobs import Job


class Events:
    def __init__(self) -> None:
        self.done: dict[str, Job] = {}

    def started(self, job: Job) -> None:
        return None

    def finished(self, job: Job) -> None:
        self.done[job.request.id] = job

    def state_changed(self) -> None:
        return None
