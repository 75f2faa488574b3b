"""The local stack: an S3 emulator, a Ray head and Airflow 3.3, all on 127.0.0.1.

    python -m tools.stack up [s3|ray|airflow ...]     start (idempotent, health-checked)
    python -m tools.stack down [s3|ray|airflow ...]   stop what `up` started (S3's objects stay on disk)
    python -m tools.stack status                      one line per process: state, pid, URL
    python -m tools.stack env                         `export K=V` lines: eval "$(python -m tools.stack env)"

Run from the repo root (make does). Configured by environment variables (defaults in brackets):
RLHF_SCRATCH [<repo>/.scratch], RLHF_AIRFLOW_PORT [8080], RLHF_S3_PORT [9000], RLHF_RAY_PORT [6379],
RLHF_RAY_DASHBOARD_PORT [8265], RLHF_RAY_CLIENT_PORT [10001], RLHF_RAY_AGENT_PORT [52365],
RLHF_BUCKET [rlhf-flow], RLHF_DAGS_FOLDER [<repo>/dags], RLHF_RAY_NUM_CPUS [2].

Every process started here gets its own session (process group); its PID file is
$RLHF_SCRATCH/pids/<name>.pid and its output $RLHF_SCRATCH/logs/<name>.log. `down` signals only those
PIDs (and their descendants); it never runs `ray stop`, which would stop every Ray on the machine.

The S3 emulator (tools/s3_server.py) writes every object through to $RLHF_SCRATCH/s3-data before it
answers, so nothing committed is lost when it stops or dies.

    config.py       Config (ports, scratch paths), process_env(): a process's whole environment
    environment.py  stack_env(): what every process of the stack gets; the Airflow connections; REPO, BIN
    credentials.py  the Airflow login, the S3 keys, the Ray token: made once into the scratch folder
    files.py        the stack's small files, written whole or once
    processes.py    PID files, logs, launch and stop, the up/down lock, the Ray and Airflow commands
    health.py       readiness checks (HEALTH, wait_healthy)
    s3.py           boto3 client for the emulator, the default bucket, the old snapshot's migration
    api.py          the Airflow REST API client (AirflowAPI)
    __main__.py     the command line: up, down, status, env, reserialize

Only the standard library, psutil and (for S3 clients) boto3 are imported, so test fixtures and
tools/demo.py can import these modules cheaply.
"""
