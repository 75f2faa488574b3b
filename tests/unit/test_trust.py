"""What a form value may reach and run (issue 53, items 1 and 2): the operator's allow-lists
(tasks/common/allowlist.py), HTTP that stays on its host (tasks/common/http_json.py), a team's Python files
pinned to their content (tasks/common/user_code.py, StageRun.code_input) and a stage cache keyed on content
(plugins/stage_cache.py). Real HTTP servers on two loopback addresses, the S3 emulator, real files."""

import hashlib

import pytest

from tasks.common import allowlist, http_json, user_code
from tasks.common import manifest as manifests
from tasks.common.config import ConfigError, StageConfig, make_config
from tasks.common.nn.environment import EnvError, load_environment
from tasks.common.stage import StageRun
from tasks.eval.config import EvalConfig
from tasks.eval.judge import ChatJudge, JudgeError
from tasks.rl.config import RLConfig

from tests.json_server import JSONServer

ENV_V1 = "class Environment:\n    def reset(self, row):\n        return 'v1'\n\n    def step(self, action):\n        return '', 1.0, True, {}\n"
ENV_V2 = ENV_V1.replace("v1", "v2")
RL = {"output": "s3://b/rl", "pretrain": "s3://b/sft", "prompt_data": "s3://b/data", "n_samples_per_prompt": 2}
EVAL = {"output": "s3://b/eval", "baseline": "s3://b/sft", "policy": "s3://b/rl", "dataset": "s3://b/data"}


class Refused(Exception):
    pass


# ------------------------------------------------------------------------------------------- the allow-lists


@pytest.mark.parametrize("host", ["127.0.0.1", "127.0.0.2", "[::1]", "localhost"])
def test_loopback_is_allowed_by_default(host, monkeypatch):
    monkeypatch.delenv(allowlist.ENV, raising=False)
    allowlist.check_url(f"http://{host}:8000/v1", "judge_url", Refused)


@pytest.mark.parametrize(
    "host", ["203.0.113.5", "169.254.169.254", "10.0.0.1", "127.0.0.1.example.com", "judge.internal"]
)
def test_any_other_host_is_refused_by_default_in_one_line(host, monkeypatch):
    monkeypatch.delenv(allowlist.ENV, raising=False)
    with pytest.raises(Refused) as caught:
        allowlist.check_url(f"http://{host}/v1", "judge_url", Refused)
    message = str(caught.value)
    assert (
        message.startswith(f"judge_url: host {host} (port 80) is not in the operator's allow-list")
        and "\n" not in message
    )
    assert "$RLHF_ALLOWED_HOSTS" in message


def test_the_operators_list_replaces_the_default():
    value = "judge.internal:443, 10.1.0.0/16 ,127.0.0.1"
    assert allowlist.host_allowed("judge.internal", 443, value) and not allowlist.host_allowed(
        "judge.internal", 80, value
    )
    assert allowlist.host_allowed("10.1.200.3", 8000, value) and not allowlist.host_allowed("10.2.0.1", 8000, value)
    assert allowlist.host_allowed("127.0.0.1", 9, value) and not allowlist.host_allowed("127.0.0.2", 9, value)
    assert not allowlist.host_allowed("::1", 9, value)
    with pytest.raises(ValueError, match=r"^RLHF_ALLOWED_HOSTS: '10.0.0.0/99' is not host"):
        allowlist.allowed_entries("10.0.0.0/99")


def test_stage_configs_refuse_an_outbound_url_before_any_job(monkeypatch):
    monkeypatch.setenv(allowlist.ENV, "127.0.0.1")
    with pytest.raises(ConfigError, match=r"^judge_url: host 169\.254\.169\.254 \(port 80\)"):
        make_config(EvalConfig, {**EVAL, "judge_url": "http://169.254.169.254/v1"})
    with pytest.raises(ConfigError, match=r"^remote_rm_url: host 127\.0\.0\.2 \(port 8000\)"):
        make_config(RLConfig, {**RL, "remote_rm_url": "tasks/data/demo_reward.py,http://127.0.0.2:8000/score"})
    make_config(RLConfig, {**RL, "remote_rm_url": "http://127.0.0.1:8000/score"})


def test_python_files_come_from_the_store_the_shipped_code_or_the_operators_folders(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "mine").mkdir()
    for ok in (
        "s3://b/env.py",
        "tasks/data/demo_reward.py",
        str(tmp_path / "code.py"),
        "file://" + str(tmp_path / "code.py"),
    ):
        assert allowlist.check_code_path(ok, "env_path", Refused, dirs="") == ok
    assert allowlist.check_code_path("/srv/teams/env.py", "env_path", Refused, dirs="/srv/teams") == "/srv/teams/env.py"
    for bad in ("/etc/passwd.py", "../outside.py", "/srv/teamsX/env.py"):
        with pytest.raises(
            Refused, match=r"^env_path: .* is on a node's own disk, outside the folders the operator allows"
        ):
            allowlist.check_code_path(bad, "env_path", Refused, dirs="/srv/teams")
    (tmp_path / "mine" / "link.py").symlink_to("/etc/hostname")  # a link out of an allowed folder is outside it
    with pytest.raises(Refused):
        allowlist.check_code_path(str(tmp_path / "mine" / "link.py"), "env_path", Refused, dirs=str(tmp_path / "mine"))
    monkeypatch.setenv(allowlist.CODE_DIRS_ENV, "/srv/teams")
    with pytest.raises(ConfigError, match=r"^env_path: /opt/env\.py is on a node's own disk"):
        make_config(RLConfig, {**RL, "env_path": "/opt/env.py"})


# ------------------------------------------------------------------------------- HTTP that stays on its host


def test_a_refused_host_gets_no_request(monkeypatch):
    monkeypatch.setenv(allowlist.ENV, "127.0.0.1")
    with JSONServer([(200, {"rewards": [1.0]})], host="127.0.0.2") as other:
        with pytest.raises(Refused, match=r"^remote_rm_url: host 127\.0\.0\.2"):
            http_json.post_json(other.url, {"query": ["q"]}, who="remote_rm_url", error=Refused, retries=0)
        assert other.requests == []


@pytest.mark.parametrize("allowed", ["127.0.0.1", "127.0.0.1,127.0.0.2"])
def test_a_redirect_to_another_host_is_not_followed_and_the_key_stays_home(allowed, monkeypatch):
    """Even to an allowed host: the judge's key was configured for the judge's host only."""
    monkeypatch.setenv(allowlist.ENV, allowed)
    monkeypatch.setenv("RLHF_JUDGE_API_KEY", "sk-judge-key")
    with JSONServer([(200, {"choices": [{"message": {"content": "A"}}]})], host="127.0.0.2") as other:
        with JSONServer([(302, {"location": other.url})], path="/v1") as judge_server:
            judge = ChatJudge(judge_server.url, "judge", retries=0)
            with pytest.raises(JudgeError) as caught:
                judge.ask("p", "a", "b")
            assert "302 redirect to http://127.0.0.2:" in str(caught.value) and "another host: not followed" in str(
                caught.value
            )
            assert "sk-judge-key" not in str(caught.value)
            assert judge_server.requests[0][1]["Authorization"] == "Bearer sk-judge-key"
        assert other.requests == []


def test_a_same_host_redirect_is_followed_without_the_authorization_header(monkeypatch):
    monkeypatch.setenv(allowlist.ENV, "127.0.0.1")
    script = [(302, {"location": "/moved"}), (200, {"rewards": [0.5]})]
    with JSONServer(script, path="/score") as server:
        reply = http_json.post_json(
            server.url,
            {"query": ["q"]},
            who="remote_rm_url",
            error=Refused,
            headers={"Authorization": "Bearer k"},
            retries=0,
        )
        assert reply == {"rewards": [0.5]}
        (first, first_headers, _), (second, second_headers, _) = server.requests
        assert (first, second) == ("/score", "/moved")
        assert first_headers["Authorization"] == "Bearer k" and "Authorization" not in second_headers


# ------------------------------------------------------------------------------ user code, by its content


def stage_run(tmp_path, name: str) -> StageRun:
    return StageRun("rl", make_config(StageConfig, {"output": str(tmp_path / name), "run_id": name}))


def test_a_stage_pins_the_file_it_runs_and_a_later_stage_refuses_a_replaced_one(s3_server, tmp_path, monkeypatch):
    """The RL stage records the environment's sha256; the file is replaced in S3; the eval stage (the policy's
    manifest in recorded_in) refuses it in one line naming both digests, and so does a worker importing the pin."""
    monkeypatch.setenv("RLHF_CACHE_DIR", str(tmp_path / "cache"))
    client, uri = s3_server.client(), s3_server.uri("envs/team_env.py")
    client.put_object(Bucket=s3_server.bucket, Key="envs/team_env.py", Body=ENV_V1.encode())
    v1, v2 = (hashlib.sha256(text.encode()).hexdigest() for text in (ENV_V1, ENV_V2))

    rl = stage_run(tmp_path, "rl")
    pinned = rl.code_input("env_path", uri, EnvError)
    assert pinned == f"{uri}#sha256={v1}" and rl.inputs["env_path"] == pinned
    assert load_environment(pinned).cls().reset({}) == "v1"
    rl.commit(metrics={})
    recorded = manifests.read_manifest(str(tmp_path / "rl"))
    assert recorded["user_code"] == {"env_path": {uri: v1}} and recorded["inputs"]["env_path"] == pinned
    rl.cleanup()

    client.put_object(Bucket=s3_server.bucket, Key="envs/team_env.py", Body=ENV_V2.encode())
    evaluation = stage_run(tmp_path, "eval")
    with pytest.raises(EnvError) as caught:
        evaluation.code_input("env_path", uri, EnvError, recorded_in=(str(tmp_path / "rl"),))
    message = str(caught.value)
    assert (
        message.startswith(f"env_path: {uri} has sha256 {v2} but {v1} was recorded in {tmp_path / 'rl'}")
        and "\n" not in message
    )
    # A worker importing the pin: the cache holds v1 under its digest, so it runs v1; asked afresh, it refuses v2.
    assert load_environment(pinned).cls().reset({}) == "v1"
    with pytest.raises(EnvError, match=f"has sha256 {v2} but {v1} was pinned"):
        user_code.fetch(pinned, "env_path", EnvError)
    # Without a record to hold it to (a policy trained with no environment), the new file is pinned as it is now.
    assert evaluation.code_input("env_path", uri, EnvError) == f"{uri}#sha256={v2}"
    evaluation.cleanup()


def test_a_reward_list_pins_its_files_and_keeps_its_urls(tmp_path, monkeypatch):
    monkeypatch.setenv("RLHF_CACHE_DIR", str(tmp_path / "cache"))
    reward = tmp_path / "team_reward.py"
    reward.write_text("def reward_func(queries, prompts, labels):\n    return [1.0] * len(queries)\n")
    run = stage_run(tmp_path, "rl")
    value = run.code_input("remote_rm_url", f"{reward},http://127.0.0.1:8000/score", EnvError)
    assert value == f"{reward}#sha256={hashlib.sha256(reward.read_bytes()).hexdigest()},http://127.0.0.1:8000/score"
    assert list(run.user_code["remote_rm_url"]) == [str(reward)]
    run.cleanup()


# ------------------------------------------------------------------------------- the stage cache, by content


def test_the_stage_cache_keys_on_the_content_of_every_input(s3_server, tmp_path, monkeypatch):
    """A replaced reward file, dataset or environment is another key: the next run computes the stage again."""
    from plugins.s3 import S3Store
    from plugins.stage_cache import StageCache
    from tools.stack.config import conn_s3

    monkeypatch.setenv("AIRFLOW_CONN_RLHF_S3", conn_s3(s3_server.endpoint, s3_server.bucket))
    client = s3_server.client()
    cache = StageCache(S3Store(), s3_server.uri("cache-test"), log=None)
    flags = {
        "env_path": s3_server.uri("cache-test/env.py"),
        "prompt_data": s3_server.uri("cache-test/data/"),
        "remote_rm_url": "rewards/team.py",
    }
    (tmp_path / "rewards").mkdir()
    (tmp_path / "rewards" / "team.py").write_text("v1")
    client.put_object(Bucket=s3_server.bucket, Key="cache-test/env.py", Body=b"v1")
    client.put_object(Bucket=s3_server.bucket, Key="cache-test/data/train.jsonl", Body=b'{"prompt": "1"}\n')
    client.put_object(Bucket=s3_server.bucket, Key="cache-test/env.py.bak", Body=b"not the file")
    first = cache.key("tasks.rl", flags, str(tmp_path))
    assert cache.key("tasks.rl", flags, str(tmp_path)) == first

    client.put_object(Bucket=s3_server.bucket, Key="cache-test/env.py.bak", Body=b"still not the file")
    assert cache.key("tasks.rl", flags, str(tmp_path)) == first
    keys = set()
    for change in ("env", "data", "reward"):
        if change == "env":
            client.put_object(Bucket=s3_server.bucket, Key="cache-test/env.py", Body=b"v2")
        elif change == "data":
            client.put_object(Bucket=s3_server.bucket, Key="cache-test/data/more.jsonl", Body=b'{"prompt": "2"}\n')
        else:
            (tmp_path / "rewards" / "team.py").write_text("v2")
        keys.add(cache.key("tasks.rl", flags, str(tmp_path)))
    assert first not in keys and len(keys) == 3  # the flags never changed: only what they name did
