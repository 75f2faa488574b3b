"""The command line: python -m tools.stack up|down|status|env|reserialize (see tools/stack/__init__.py)."""

from __future__ import annotations

import argparse
import shlex
import subprocess
import sys
import threading
import time
from typing import Iterable

import psutil

import tools.stack
from tasks.common import names
from tools.stack.config import (
    AIRFLOW_PROCS,
    BIN,
    COMPONENTS,
    LOOPBACK,
    ORDER,
    REPO,
    Config,
    StackError,
    _all_procs,
    airflow_login,
    process_env,
    ray_token_file,
    say,
)
from tools.stack.health import HEALTH, wait_healthy
from tools.stack.processes import (
    airflow_commands,
    config_for_up,
    current_config,
    gpu_slots,
    launch,
    orphan_of,
    pid_file,
    port_owner,
    reserialize,
    run_logged,
    running,
    stack_lock,
    start_ray,
    stop_process,
)
from tools.stack.s3 import ensure_bucket, migrate_snapshot

START_TIMEOUT = {"s3": 30.0, "ray": 120.0, "airflow": 180.0}


def _mb(n: int) -> str:
    return f"{n / 1e6:.1f} MB"


def up(cfg: Config, components: Iterable[str] = ORDER) -> None:
    """Start what is not running; leave alone what runs and answers; wait until everything is healthy."""
    t0 = time.monotonic()
    wanted = [c for c in ORDER if c in set(components)]
    cfg.check_ports()
    recorded = Config.load(cfg.scratch)
    if recorded is not None:
        live = [n for n in _all_procs() if running(recorded, n)]
        diff = {k: (v, recorded.to_json()[k]) for k, v in cfg.to_json().items() if v != recorded.to_json()[k]}
        if live and diff:
            what = ", ".join(f"{k} {old} (asked {new})" for k, (new, old) in diff.items())
            raise StackError(f"the stack in {cfg.scratch} runs with {what}: run `down` first")
    cfg.scratch.mkdir(parents=True, exist_ok=True)
    env = process_env(cfg)
    cfg.save()

    started: dict[str, dict[str, subprocess.Popen | psutil.Process]] = {}
    kept: dict[str, dict[str, psutil.Process]] = {}

    def need(procs: Iterable[str]) -> list[str]:
        return [n for n in procs if running(cfg, n) is None]

    def check_free(var_ports: dict[str, int]) -> None:
        for var, port in var_ports.items():
            owner = port_owner(port)
            if owner and (orphan := orphan_of(cfg, port)) is not None:
                say(f"port {port} ({var}): stopping pid {orphan.pid}, a process of this stack no PID file names")
                stop_process(orphan.pid)
                owner = port_owner(port)
            if owner:
                raise StackError(f"port {port} ({var}) is already in use by {owner}: set {var} to another port")

    # S3 emulator: quick, started first so the others find it.
    if "s3" in wanted:
        if need(["s3"]):
            check_free({"RLHF_S3_PORT": cfg.s3_port})
            proc = launch(
                cfg,
                "s3",
                [
                    str(BIN / "python"),
                    str(REPO / "tools" / "s3_server.py"),
                    "--host",
                    LOOPBACK,
                    "--port",
                    str(cfg.s3_port),
                    "--data",
                    str(cfg.s3_data),
                ],
                env,
            )
            started["s3"] = {"s3": proc}
        else:
            kept["s3"] = {"s3": running(cfg, "s3")}

    if "ray" in wanted:
        if need(["ray"]):
            check_free({k: v for k, v in cfg.ports().items() if "RAY" in k})
            started["ray"] = {"ray": start_ray(cfg, env)}
        else:
            kept["ray"] = {"ray": running(cfg, "ray")}

    if "airflow" in wanted:
        missing = need(AIRFLOW_PROCS)
        if missing:
            if "airflow-api-server" in missing:
                check_free({"RLHF_AIRFLOW_PORT": cfg.airflow_port})
            cfg.airflow_home.mkdir(parents=True, exist_ok=True)
            run_logged(cfg, "airflow-db-migrate", [str(BIN / "airflow"), "db", "migrate"], env, timeout=300)
            # include_deferred: a stage waiting on its Ray job in the triggerer still holds its GPUs.
            run_logged(
                cfg,
                "airflow-pool",
                [
                    str(BIN / "airflow"),
                    "pools",
                    "set",
                    names.GPU_POOL,
                    str(gpu_slots()),
                    "GPUs the Ray stages hold",
                    "--include-deferred",
                ],
                env,
                timeout=300,
            )
            cmds = airflow_commands()
            started["airflow"] = {n: launch(cfg, n, cmds[n], env) for n in missing}
            for n in AIRFLOW_PROCS:
                if n not in missing:
                    started["airflow"][n] = running(cfg, n)
        else:
            kept["airflow"] = {n: running(cfg, n) for n in AIRFLOW_PROCS}

    def since() -> str:
        return f" [{time.monotonic() - t0:.1f}s]" if started else ""

    for comp in wanted:
        procs = started.get(comp) or kept.get(comp)
        fresh = comp in started
        try:
            wait_healthy(cfg, comp, procs, START_TIMEOUT[comp] if fresh else 60)
        except StackError:
            # What this call started and is not healthy goes again; the next `up` starts it afresh.
            for name, proc in started.get(comp, {}).items():
                if isinstance(proc, subprocess.Popen):
                    stop_process(proc.pid, grace=5)
                    pid_file(cfg, name).unlink(missing_ok=True)
            raise
        pids = ", ".join(f"{n} {p.pid}" for n, p in procs.items())
        if comp == "s3":
            ensure_bucket(cfg)
            note = ""
            if fresh:
                n, size = migrate_snapshot(cfg)
                note = f", migrated {n} objects ({_mb(size)}) from {cfg.snapshot}" if n else ""
                note += f", objects in {cfg.s3_data}"
            say(f"s3       {'started' if fresh else 'already running'}: {cfg.s3_endpoint} bucket {cfg.bucket} "
                f"(pid {pids}){note}{since()}")  # fmt: skip
        elif comp == "ray":
            say(f"ray      {'started' if fresh else 'already running'}: dashboard {cfg.dashboard_url}, "
                f"gcs {LOOPBACK}:{cfg.ray_port}, token in {ray_token_file(cfg.scratch)} (pid {pids}){since()}")  # fmt: skip
        elif comp == "airflow":
            if fresh:
                reserialize(cfg, env)
            user, password = airflow_login(cfg.scratch)
            say(f"airflow  {'started' if fresh else 'already running'}: {cfg.airflow_url} login {user} / {password} "
                f"({pids}){since()}")  # fmt: skip
    say(f"stack up in {time.monotonic() - t0:.1f}s (scratch {cfg.scratch}; logs in {cfg.logs})")


def down(cfg: Config, components: Iterable[str] = ORDER) -> None:
    """Stop only the processes recorded in the PID files: Airflow, then Ray, then S3."""
    wanted = set(components)
    if not any(running(cfg, n) for c in wanted for n in COMPONENTS[c]):
        say(f"nothing running in {cfg.scratch}")
    for comp in reversed(ORDER):
        if comp not in wanted:
            continue
        procs = {}
        for name in COMPONENTS[comp]:
            proc = running(cfg, name)
            if proc is None:
                pid_file(cfg, name).unlink(missing_ok=True)
            else:
                procs[name] = proc

        def stop(name: str, proc: psutil.Process) -> None:
            t = time.monotonic()
            stop_process(proc.pid)
            pid_file(cfg, name).unlink(missing_ok=True)
            say(f"{name:<8} stopped (pid {proc.pid}, {time.monotonic() - t:.1f}s)")

        # The processes of one component stop in parallel (the triggerer alone can take 10 s).
        threads = [threading.Thread(target=stop, args=item) for item in procs.items()]
        for th in threads:
            th.start()
        for th in threads:
            th.join()


def status(cfg: Config) -> bool:
    """Print one line per process; True if everything runs and answers."""
    ok_all = True
    health = {c: HEALTH[c](cfg) for c in ORDER if any(running(cfg, n) for n in COMPONENTS[c])}
    urls = {"s3": cfg.s3_endpoint, "ray": cfg.dashboard_url, "airflow-api-server": cfg.airflow_url}
    say(f"stack in {cfg.scratch}")
    for comp in ORDER:
        for name in COMPONENTS[comp]:
            proc = running(cfg, name)
            if proc is None:
                state, pid, ok_all = "stopped", "-", False
            else:
                ok, detail = health.get(comp, (False, ""))
                state = "running" if ok else f"running, not healthy ({detail})"
                pid = str(proc.pid)
                ok_all = ok_all and ok
            say(f"  {name:<22} {state:<10} pid {pid:<8} {urls.get(name, '')}")
    if running(cfg, "airflow-api-server"):
        user, password = airflow_login(cfg.scratch)
        say(f"  airflow login: {user} / {password}")
    say(f"  logs: {cfg.logs}")
    return ok_all


def print_env(cfg: Config) -> None:
    env = cfg.env()
    env["RAY_ADDRESS"] = cfg.dashboard_url  # for `ray job submit/list` from a shell; not given to the stack
    for k in sorted(env):
        print(f"export {k}={shlex.quote(env[k])}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tools.stack", description=tools.stack.__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="cmd", required=True)
    p_up = sub.add_parser("up", help="start the stack (idempotent)")
    p_up.add_argument("components", nargs="*", metavar="{s3,ray,airflow}", help="default: all")
    p_down = sub.add_parser("down", help="stop what up started")
    p_down.add_argument("components", nargs="*", metavar="{s3,ray,airflow}", help="default: all")
    sub.add_parser("status", help="show each process")
    sub.add_parser("env", help="print export lines for the stack's environment")
    p_rs = sub.add_parser("reserialize", help="airflow dags reserialize against the running stack")
    del p_rs
    args = parser.parse_args(argv)
    bad = [c for c in getattr(args, "components", None) or [] if c not in ORDER]
    if bad:
        parser.error(f"unknown component {bad[0]!r} (choose from {', '.join(ORDER)})")
    try:
        if args.cmd == "up":
            cfg = config_for_up()
            with stack_lock(cfg):
                up(cfg, args.components or ORDER)
        elif args.cmd == "down":
            cfg = current_config()
            with stack_lock(cfg):
                down(cfg, args.components or ORDER)
        elif args.cmd == "status":
            status(current_config())
        elif args.cmd == "env":
            print_env(current_config())
        elif args.cmd == "reserialize":
            reserialize(current_config())
    except StackError as e:
        print(f"stack: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("stack: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # `python -m tools.stack status | head`
        sys.stdout = None
        return 0
    return 0


if __name__ == "__main__":
    sys.exit(main())
