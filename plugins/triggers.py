"""RayJobTrigger: waits for a Ray job in the triggerer and streams its driver log into the task log."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from typing import Any

from airflow.triggers.base import BaseTrigger, TriggerEvent

from plugins.hooks import TERMINAL_STATUSES, RayAuthError, RayJobHook
from tasks.common import names

LOG_TAIL_LINES = 40
# How long a stop waits for Ray to report the job ended (Ray escalates SIGTERM to a kill after 3 s);
# below the triggerer's on_kill timeout (30 s).
STOP_WAIT_S = 20.0
# How long Ray may stay unreachable (consecutive failed polls) before the trigger gives up on the job.
DEFAULT_UNREACHABLE_GRACE_S = 120.0


def split_new_lines(logs: str, offset: int, final: bool = False) -> tuple[list[str], int]:
    """Complete lines of ``logs`` past ``offset`` and the offset after them.

    A partial last line is kept back (its offset is not passed) until it ends or ``final`` is set.
    """
    if offset > len(logs):  # the log was truncated or replaced: start over rather than go silent
        offset = 0
    chunk = logs[offset:]
    if not final:
        cut = chunk.rfind("\n")
        if cut < 0:
            return [], offset
        chunk = chunk[: cut + 1]
    return chunk.splitlines(), offset + len(chunk)


def log_tail(logs: str, n: int = LOG_TAIL_LINES) -> str:
    return "\n".join(logs.rstrip("\n").splitlines()[-n:])


def job_event(submission_id: str, status: str, message: str, logs: str, exit_code: int | None = None) -> dict[str, Any]:
    """What the operator's ``execute_complete`` gets when a job ended, from the trigger or from the worker."""
    return {
        "status": status,
        "submission_id": submission_id,
        "message": message,
        "log_tail": log_tail(logs),
        "exit_code": exit_code,
    }


class RayJobTrigger(BaseTrigger):
    """Poll a Ray job until it ends; log the driver's new log lines on every poll.

    Fires one event: ``{"status", "submission_id", "message", "log_tail", "exit_code"}`` (the driver's exit
    status when Ray knows it, else None); ``status`` is Ray's terminal
    status (SUCCEEDED, FAILED, STOPPED), or MISSING when Ray does not know the job, or UNREACHABLE when
    Ray could not be reached for ``unreachable_grace_s`` seconds, or DEADLINE when the job ran longer
    than ``deadline_s`` and was stopped. The deadline is enforced here, not by ``execution_timeout``,
    because a deferred task's timeout does not run; it counts from the job's own start time, so a
    restarted triggerer keeps the same deadline.

    :param address: the Ray dashboard address, ``http://host:port``.
    :param submission_id: the job to follow.
    :param ray_conn_id: the connection whose token (its password) the polls carry. Only its name is
        serialized: the token is read from the connection in the triggerer, never stored with the trigger.
    :param poll_interval: seconds between polls.
    :param log_offset: characters of the driver log already shown (a resumed trigger skips them).
    :param deadline_s: stop the job once it has run this many seconds (None: no deadline).
    :param not_before: fire no event before this time (epoch seconds). A task that deferred is seen as
        deferred by the scheduler only once its worker process has exited (seconds later); an event that
        comes first gets the resumed task marked for retry ("task state changed externally",
        apache/airflow#66374 and #72716), so the operator sets this a few seconds past its deferral.
    """

    def __init__(
        self,
        address: str,
        submission_id: str,
        ray_conn_id: str = names.RAY_CONN,
        poll_interval: float = 2.0,
        log_offset: int = 0,
        unreachable_grace_s: float = DEFAULT_UNREACHABLE_GRACE_S,
        deadline_s: float | None = None,
        not_before: float = 0.0,
    ) -> None:
        super().__init__()
        self.address = address
        self.submission_id = submission_id
        self.ray_conn_id = ray_conn_id
        self.poll_interval = float(poll_interval)
        self.log_offset = int(log_offset)
        self.unreachable_grace_s = float(unreachable_grace_s)
        self.deadline_s = float(deadline_s) if deadline_s else None
        self.not_before = float(not_before or 0.0)

    def serialize(self) -> tuple[str, dict[str, Any]]:
        return (
            "plugins.triggers.RayJobTrigger",
            {
                "address": self.address,
                "submission_id": self.submission_id,
                "ray_conn_id": self.ray_conn_id,
                "poll_interval": self.poll_interval,
                "log_offset": self.log_offset,
                "unreachable_grace_s": self.unreachable_grace_s,
                "deadline_s": self.deadline_s,
                "not_before": self.not_before,
            },
        )

    def _hook(self) -> RayJobHook:
        return RayJobHook(self.ray_conn_id, address=self.address)

    def _emit(self, lines: list[str]) -> None:
        for line in lines:
            self.log.info("[ray %s] %s", self.submission_id, line)

    async def _event(self, status: str, message: str, logs: str, exit_code: int | None = None) -> TriggerEvent:
        early = self.not_before - time.time()
        if early > 0:
            await asyncio.sleep(early)
        return TriggerEvent(job_event(self.submission_id, status, message, logs, exit_code))

    async def run(self) -> AsyncIterator[TriggerEvent]:
        hook = self._hook()
        loop = asyncio.get_running_loop()
        logs = ""
        failing_since: float | None = None
        last_status = None
        self.log.info(
            "Following Ray job %s at %s (dashboard: %s)",
            self.submission_id,
            self.address,
            hook.dashboard_url(self.submission_id),
        )
        while True:
            try:
                info = await hook.get_status(self.submission_id)
                if info is None:
                    yield await self._event(
                        "MISSING", f"Ray at {self.address} does not know job {self.submission_id}", logs
                    )
                    return
                status = str(info.get("status") or "UNKNOWN")
                terminal = status in TERMINAL_STATUSES
                fetched = await hook.get_logs(self.submission_id)
                failing_since = None
            except RayAuthError as exc:  # a refused token does not heal by waiting: say so at once
                yield await self._event("UNREACHABLE", str(exc), logs)
                return
            except Exception as exc:  # Ray restarting / network blip: keep waiting for a while
                now = loop.time()
                failing_since = failing_since if failing_since is not None else now
                if now - failing_since >= self.unreachable_grace_s:
                    yield await self._event("UNREACHABLE", f"{exc} (for {now - failing_since:.0f}s)", logs)
                    return
                self.log.warning("Polling Ray job %s failed, retrying: %s", self.submission_id, exc)
                await asyncio.sleep(self.poll_interval)
                continue

            if fetched is not None:
                logs = fetched
            lines, self.log_offset = split_new_lines(logs, self.log_offset, final=terminal)
            self._emit(lines)
            if status != last_status:
                self.log.info("Ray job %s is %s", self.submission_id, status)
                last_status = status
            if terminal:
                message = str(info.get("message") or "")
                yield await self._event(status, message, logs, info.get("driver_exit_code"))
                return
            ran_s = time.time() - float(info.get("start_time") or time.time() * 1000) / 1000
            if self.deadline_s is not None and ran_s > self.deadline_s:
                await self._stop_and_wait(hook)
                yield await self._event(
                    "DEADLINE", f"ran {ran_s:.0f}s, past its deadline of {self.deadline_s:.0f}s: stopped", logs
                )
                return
            await asyncio.sleep(self.poll_interval)

    async def _stop_and_wait(self, hook: RayJobHook, wait_s: float = STOP_WAIT_S) -> bool:
        """Stop the job (Ray's stop: SIGTERM, then kill; never delete) and wait until Ray reports it ended,
        so that a new attempt starting right after never finds it still running."""
        stopped = await hook.astop_job(self.submission_id)
        self.log.info("Stop requested for Ray job %s (was live: %s)", self.submission_id, stopped)
        deadline = time.monotonic() + wait_s
        while time.monotonic() < deadline:
            info = await hook.get_status(self.submission_id)
            if info is None or str(info.get("status")) in TERMINAL_STATUSES:
                return stopped
            await asyncio.sleep(0.5)
        self.log.warning("Ray job %s still not ended %.0fs after the stop request", self.submission_id, wait_s)
        return stopped

    async def on_kill(self) -> None:
        """The user killed the deferred task (mark failed / success, clear; also a whole run marked failed):
        stop the Ray job too."""
        try:
            await self._stop_and_wait(self._hook())
        except Exception as exc:
            self.log.warning("Could not stop Ray job %s: %s", self.submission_id, exc)
