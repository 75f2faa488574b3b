"""The supervisor: start, find and stop the stack's processes (S3 emulator, Ray head, Airflow).

Every process gets its own session (process group); its PID file is <scratch>/pids/<name>.pid and its
output <scratch>/logs/<name>.log. stop_process() signals only such a PID and its descendants.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import shlex
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path
from typing import Iterable

import psutil

from tools.stack.config import BIN, LOOPBACK, REPO, Config, StackError, _all_procs, process_env, say
from tools.stack.files import atomic_write

# --------------------------------------------------------------------------------------------------
# PID files, logs, process groups


def pid_file(cfg: Config, name: str) -> Path:
    return cfg.pids / f"{name}.pid"


def log_file(cfg: Config, name: str) -> Path:
    return cfg.logs / f"{name}.log"


def running(cfg: Config, name: str) -> psutil.Process | None:
    """The live process recorded in <name>.pid, or None (missing file, dead, zombie or a recycled PID)."""
    path = pid_file(cfg, name)
    try:
        fields = path.read_text().split()
        pid = int(fields[0])
        proc = psutil.Process(pid)
        if proc.status() == psutil.STATUS_ZOMBIE:
            return None
        # A recycled PID is not ours. The start time recorded at launch is compared with the same clock
        # (psutil's boot time + the kernel's start ticks), never with the file's mtime: on a host whose wall
        # clock has been stepped since boot the two disagree by seconds, and `down` would miss a live process.
        if len(fields) > 1:
            return proc if abs(proc.create_time() - float(fields[1])) < 1.0 else None
        return proc if proc.create_time() <= path.stat().st_mtime + 2 else None  # a file of an older stack
    except (OSError, ValueError, IndexError, psutil.Error):
        return None


def _open_log(cfg: Config, name: str, cmd: list[str]):
    """logs/<name>.log opened for appending, a header line with the time and the command already in it."""
    cfg.logs.mkdir(parents=True, exist_ok=True)
    log = open(log_file(cfg, name), "ab")
    log.write(f"\n=== {time.strftime('%Y-%m-%d %H:%M:%S')} {shlex.join(cmd)}\n".encode())
    log.flush()
    return log


def launch(cfg: Config, name: str, cmd: list[str], env: dict[str, str], cwd: Path | None = None) -> subprocess.Popen:
    """Start cmd in its own session (pgid == pid), output appended to logs/<name>.log, PID in pids/<name>.pid."""
    cfg.pids.mkdir(parents=True, exist_ok=True)
    log = _open_log(cfg, name, cmd)
    try:
        proc = subprocess.Popen(
            cmd,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            env=env,
            cwd=str(cwd or REPO),
            start_new_session=True,
        )
    finally:
        log.close()
    try:
        started = f" {psutil.Process(proc.pid).create_time()!r}"
    except psutil.Error:  # gone already: `running` then finds nothing either way
        started = ""
    atomic_write(pid_file(cfg, name), f"{proc.pid}{started}\n")
    return proc


def _group(pgid: int) -> list[psutil.Process]:
    out = []
    for proc in psutil.process_iter():
        try:
            if os.getpgid(proc.pid) == pgid:
                out.append(proc)
        except (OSError, psutil.Error):
            pass
    return out


def alive(procs: Iterable[psutil.Process]) -> list[psutil.Process]:
    """The processes of procs still running (a zombie is not: it has exited, only its reaping is left)."""
    out = []
    for p in procs:
        try:
            if p.is_running() and p.status() != psutil.STATUS_ZOMBIE:
                out.append(p)
        except psutil.Error:
            pass
    return out


def stop_process(pid: int, grace: float = 20.0) -> None:
    """Stop a process we started and everything it started: its descendants and its process group.

    SIGTERM goes to the leader first (`ray start --block` then drains and stops its own children in
    about 3 s; sending it to the whole group makes Ray's drain wait 30 s for a GCS already gone), then to
    the remaining group members, then SIGKILL to whatever is left.
    """
    try:
        leader = psutil.Process(pid)
    except psutil.NoSuchProcess:
        return
    try:
        pgid = os.getpgid(pid)
    except OSError:
        pgid = None
    members = {leader}
    try:
        members.update(leader.children(recursive=True))
    except psutil.Error:
        pass
    if pgid == pid:  # only a group we made (start_new_session) is ours to signal
        members.update(_group(pgid))

    def wait(procs, timeout):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            left = alive(procs)
            if not left:
                return []
            time.sleep(0.1)
        return alive(procs)

    with _suppress():
        leader.send_signal(signal.SIGTERM)
    left = wait(members, grace)
    if left:
        for p in left:
            with _suppress():
                p.send_signal(signal.SIGTERM)
        left = wait(left, 5)
    if pgid == pid:
        left = list({*left, *alive(_group(pgid))})
    for p in left:
        with _suppress():
            p.kill()
    wait(left, 5)
    with _suppress():
        leader.wait(0)  # reap it if it is our child


class _suppress:
    def __enter__(self):
        return self

    def __exit__(self, et, ev, tb):
        return et is not None and issubclass(et, (psutil.Error, OSError, subprocess.TimeoutExpired))


def tail(path: Path, lines: int = 1) -> str:
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - 65536))
            text = f.read().decode(errors="replace")
    except OSError:
        return ""
    rows = [r for r in text.splitlines() if r.strip() and not r.startswith("=== ")]
    return "\n".join(rows[-lines:])


def port_owner(port: int) -> str | None:
    """Who listens on 127.0.0.1:port (or any address), as 'pid N (name)', or None if the port is free."""
    with socket.socket() as s:
        # SO_REUSEADDR as the servers use it: TIME_WAIT leftovers of a stack just stopped do not count.
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((LOOPBACK, port))
            return None
        except OSError:
            pass
    proc = port_listener(port)
    if proc is None:
        return "another process"
    try:
        return f"pid {proc.pid} ({proc.name()})"
    except psutil.Error:
        return f"pid {proc.pid}"


def port_listener(port: int) -> psutil.Process | None:
    """The process listening on port, where this user may see it."""
    try:
        for c in psutil.net_connections(kind="inet"):
            if c.status == psutil.CONN_LISTEN and c.laddr and c.laddr.port == port and c.pid:
                return psutil.Process(c.pid)
    except psutil.Error:
        pass
    return None


def orphan_of(cfg: Config, port: int) -> psutil.Process | None:
    """A process of this stack (its RLHF_SCRATCH is cfg.scratch) listening on port though no PID file names it:
    left behind by a `down` that never ran (a deleted pids/ folder, a killed `up`)."""
    proc = port_listener(port)
    try:
        if proc is not None and proc.environ().get("RLHF_SCRATCH") == str(cfg.scratch):
            return proc
    except psutil.Error:
        pass
    return None


def live_pids(scratch: Path) -> list[int]:
    """PIDs recorded under <scratch>/pids that are still our processes."""
    cfg = Config(scratch=Path(scratch))
    out = []
    for path in sorted(cfg.pids.glob("*.pid")) if cfg.pids.is_dir() else []:
        proc = running(cfg, path.stem)
        if proc is not None:
            out.append(proc.pid)
    return out


def remove_scratch(scratch: Path) -> None:
    """Delete a scratch folder, and Ray's temp dir when it lives in /tmp (see Config.ray_temp_dir)."""
    scratch = Path(scratch)
    link = scratch / "ray"
    if link.is_symlink():
        shutil.rmtree(link.resolve(), ignore_errors=True)
    shutil.rmtree(scratch, ignore_errors=True)


# --------------------------------------------------------------------------------------------------
# Which stack (the one recorded while it runs), and one `up` or `down` of it at a time


def current_config(environ: dict[str, str] | None = None) -> Config:
    """The configuration of the stack in $RLHF_SCRATCH.

    While any of it runs: the recorded one (stack.json), so `down`, `status`, `env`, tools/demo.py and a
    second `up` find a stack started on other ports without repeating the variables. Otherwise the
    RLHF_* variables over the defaults.
    """
    asked = Config.from_env(environ)
    recorded = Config.load(asked.scratch)
    if recorded is not None and any(running(recorded, n) for n in _all_procs()):
        return recorded
    return asked


def config_for_up(environ: dict[str, str] | None = None) -> Config:
    """current_config(), with the RLHF_* variables that are set on top (up refuses them if they differ)."""
    return Config.from_env(environ, base=current_config(environ))


@contextlib.contextmanager
def stack_lock(cfg: Config):
    """One `up` or `down` of a stack at a time: two at once would both start (or stop) the same parts and
    leave it half up. The second waits for the first, then finds what it left."""
    cfg.scratch.mkdir(parents=True, exist_ok=True)
    with open(cfg.scratch / "stack.lock", "w") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            say(f"waiting for another `up` or `down` of {cfg.scratch} to finish")
            fcntl.flock(lock, fcntl.LOCK_EX)
        yield


# --------------------------------------------------------------------------------------------------
# Components


def ray_command(cfg: Config) -> list[str]:
    return [
        str(BIN / "ray"), "start", "--head", "--block",
        "--port", str(cfg.ray_port),
        "--dashboard-host", LOOPBACK,
        "--dashboard-port", str(cfg.dashboard_port),
        "--ray-client-server-port", str(cfg.ray_client_port),
        "--dashboard-agent-listen-port", str(cfg.ray_agent_port),
        "--temp-dir", str(cfg.ray_temp_dir),
        "--num-cpus", str(cfg.num_cpus),
        "--include-dashboard", "true",
        "--disable-usage-stats",
    ]  # fmt: skip


def start_ray(cfg: Config, env: dict[str, str], name: str = "ray") -> subprocess.Popen:
    """Start `ray start --head --block` (one parent whose group `down` kills); does not wait."""
    temp = cfg.ray_temp_dir
    temp.mkdir(parents=True, exist_ok=True)
    link = cfg.scratch / "ray"
    if temp != link and not link.exists():
        with _suppress():
            link.symlink_to(temp)
    return launch(cfg, name, ray_command(cfg), env)


def airflow_commands() -> dict[str, list[str]]:
    af = str(BIN / "airflow")
    return {
        "airflow-api-server": [af, "api-server"],  # host and port from AIRFLOW__API__HOST/PORT
        "airflow-scheduler": [af, "scheduler", "--skip-serve-logs"],
        "airflow-dag-processor": [af, "dag-processor"],
        "airflow-triggerer": [af, "triggerer", "--skip-serve-logs"],
    }


def gpu_slots() -> int:
    """Slots of the GPU pool: RLHF_GPU_SLOTS, else the GPUs nvidia-smi lists, at least 1 (a CPU box runs
    one stage at a time)."""
    if os.environ.get("RLHF_GPU_SLOTS"):
        return max(1, int(os.environ["RLHF_GPU_SLOTS"]))
    try:
        out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=20).stdout
    except (OSError, subprocess.SubprocessError):
        return 1
    return max(1, sum(1 for line in out.splitlines() if line.startswith("GPU ")))


def run_logged(cfg: Config, name: str, cmd: list[str], env: dict[str, str], timeout: float) -> None:
    """Run a one-shot command to completion, output appended to logs/<name>.log."""
    with _open_log(cfg, name, cmd) as log:
        try:
            code = subprocess.run(
                cmd,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=env,
                cwd=str(REPO),
                timeout=timeout,
            ).returncode
        except subprocess.TimeoutExpired:
            raise StackError(f"`{' '.join(cmd[1:])}` took over {timeout:.0f}s: see {log_file(cfg, name)}") from None
    if code != 0:
        raise StackError(
            f"`{' '.join(cmd[1:])}` failed (code {code}): see {log_file(cfg, name)} (last line: {tail(log_file(cfg, name))[-300:]})"
        )


def reserialize(cfg: Config, env: dict[str, str] | None = None) -> None:
    """`airflow dags reserialize`: parse the DAG folder now instead of at the DAG processor's next pass."""
    run_logged(cfg, "airflow-reserialize", [str(BIN / "airflow"), "dags", "reserialize"],
               env or process_env(cfg), timeout=300)  # fmt: skip
