"""Running stages in the test's own process (tasks.common.stage.run) against the test Ray head: the environment they
read set for the block and put back after it, and the JSONL files they take.

    with stages_in_this_process(ray_address, root):     # RAY_ADDRESS, a node cache under root
        stage.run("rl", make_config(RLConfig, values), train)
    uri = write_jsonl(root / "prompts.jsonl", [{"prompt": "…"}])
"""

import contextlib
import json
import os


def write_jsonl(path, rows) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


@contextlib.contextmanager
def stages_in_this_process(ray_address: str, root):
    """RAY_ADDRESS and RLHF_CACHE_DIR (root/cache) for the block, restored after it; this process leaves the Ray head
    it joined through the stages' connect_ray."""
    import ray

    saved = {k: os.environ.get(k) for k in ("RAY_ADDRESS", "RLHF_CACHE_DIR")}
    os.environ.update(RAY_ADDRESS=ray_address, RLHF_CACHE_DIR=str(root / "cache"))
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        ray.shutdown()
