"""The eval stage's models on a device of their own: a Ray worker that generates and measures; the driver
keeps the metrics, the intervals and the report (tasks/eval/evaluate.py).

    with placed_group(EvalWorker, num_nodes=1, gpus_per_node=1, name="eval") as group:
        group.run("setup", cfg, baseline_uri)
        side = group.run("generate_side", policy_uri, prompts, rows, labels)[0]
        side["greedy"], side["sampled"]       # texts: one greedy response per prompt, n samples per prompt in a row
        side["kl_to_ref"], side["response_length"], side["reward_mean"]   # per sample; reward_mean None without a reward model
        side["episodes"]                      # with --env_path: one greedy episode's summary per prompt
        side["seconds"]                       # where the side's time went: load, greedy, sampled, kl, reward, …
        side["lm_eval"]                       # with --lm_eval_tasks: (scores per document by metric, lm-eval's table)

The worker takes a GPU when the cluster has one (a CPU otherwise), like the training stages' workers, and
generates through the same rollout-engine slot as RL: the transformers engine on its device, or with
--rollout_engine vllm (auto's choice on a GPU) one vLLM engine on its GPU that is loaded with each model's weights in turn (the models
compared share the baseline's architecture). Models are fetched on the worker's own node.

A vision-language baseline (its config has a vision_config) makes every side one: each prompt is encoded with the
images of its row (--image_key) and generated from them, greedy and sampled, its KL scored with them
(tasks/eval/images.py); the metrics are the text ones, on the responses.
"""

from __future__ import annotations

import importlib.util
import time

import torch

from tasks.common import storage
from tasks.common.config import ConfigError, split_list
from tasks.common.nn import data
from tasks.common.nn.engines import make_engine
from tasks.common.nn.engines.rollout import Rollout
from tasks.common.nn.environment import episode_runner
from tasks.common.nn.models import load_causal_lm, load_tokenizer, resolve_model, sequence_logprobs, use_liger
from tasks.common.nn.rewards import RewardModels, build_reward_batch
from tasks.common.nn.strategy import set_seed
from tasks.common.nn.workers import Worker
from tasks.eval import images, lm_eval_tasks
from tasks.eval.config import EvalConfig


def repeat(values, n: int) -> list:
    """Each value n times in a row: the layout of n samples per prompt."""
    return [v for v in values for _ in range(n)]


@torch.no_grad()
def summed_logprobs(model, rollout: Rollout, batch_size: int = 256, vision=None) -> torch.Tensor:
    """Σ log π(response tokens) per sequence; vision (a VisionRows): a VLM's rows, scored with their images."""
    device = next(model.parameters()).device
    out = []
    for i in range(0, rollout.sequences.size(0), batch_size):
        seqs, mask = (
            rollout.sequences[i : i + batch_size].to(device),
            rollout.attention_mask[i : i + batch_size].to(device),
        )
        if vision is not None:
            rows = rollout.images[i : i + batch_size]
            logprobs = vision.logprobs(model, seqs, mask, rows, start=rollout.prompt_width - 1)
        else:
            logprobs = sequence_logprobs(model, seqs, mask, start=rollout.prompt_width - 1)
        out.append((logprobs * rollout.response_mask[i : i + batch_size].to(device)).sum(-1).cpu())
    return torch.cat(out)


class EvalWorker(Worker):
    def setup(self, cfg: EvalConfig, baseline_uri: str) -> None:
        self.cfg = cfg
        self.device = (
            torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
        )
        self.baseline_uri = baseline_uri
        path = resolve_model(baseline_uri)
        # --bf16 halves the KL pass's work; on CUDA Liger's kernels take the log-probs a chunk of tokens at a time,
        # never a batch's full logits ([256, 383, 151936] in fp32 is 60 GB for the bench's model).
        self.load_kwargs = {"dtype": torch.bfloat16 if cfg.bf16 else torch.float32, "liger": use_liger(True)}
        # A vision-language baseline: its processor and the ids never sampled; every side is scored with its images.
        self.vision = images.vision_rows(path, cfg)
        self.reference = self._load(path)
        # Raw scores (not standardised), summed over the models of a comma-separated list, as in RL.
        self.reward = (
            RewardModels(cfg.reward_pretrain, device=self.device, normalize=False) if cfg.reward_pretrain else None
        )
        # lm-eval's registry (thousands of task files: seconds to scan) once, unknown task names refused before any side runs
        self.lm_eval = (
            lm_eval_tasks.task_manager(split_list(cfg.lm_eval_tasks), self._include_path())
            if cfg.lm_eval_tasks
            else None
        )
        self.vllm = None
        self.engine_name, why = cfg.choose_rollout_engine(
            self.device.type == "cuda", importlib.util.find_spec("vllm") is not None
        )
        print(f"eval: rollout engine {self.engine_name} ({why})", flush=True)
        if self.engine_name == "vllm":
            if self.device.type != "cuda":
                raise ConfigError(
                    "rollout_engine: vLLM generates on a GPU and this eval worker has none; use --rollout_engine transformers"
                )
            self.vllm = make_engine(
                "vllm",
                load_tokenizer(path),
                **images.vllm_options(self.vision, cfg),
                path=path,  # as long as the model's positions
                gpu_memory_utilization=cfg.vllm_gpu_memory_utilization,
                seed=cfg.seed,
                dtype="bfloat16",
                logprobs=False,
                # A 1,000-prompt call decodes its whole batch in each step from a CUDA graph, not eagerly
                max_num_seqs=1024,
            )

    def _load(self, path: str):
        if self.vision is not None:
            return images.load_vision_model(path, self.load_kwargs["dtype"]).to(self.device).eval()
        return load_causal_lm(path, **self.load_kwargs).to(self.device).eval()

    def _include_path(self) -> str | None:
        """--lm_eval_include_path as a folder on this node: an s3:// prefix is downloaded into the node's scratch."""
        uri = self.cfg.lm_eval_include_path
        if not uri or not storage.is_s3(uri):
            return uri or None
        import tempfile

        return str(storage.download_dir(uri, tempfile.mkdtemp(prefix="lm_eval_tasks-", dir=self.scratch)))

    def _engine(self, model, tokenizer):
        if self.vllm is None and self.vision is not None:  # the model's own generate, with the pixels
            return make_engine(
                "transformers", tokenizer, module=model, device=self.device, processor=self.vision.processor
            )
        if self.vllm is None:
            return make_engine(
                "transformers", tokenizer, module=model, device=self.device, cuda_graphs=self.device.type == "cuda"
            )
        self.vllm.load_named((name, param.data) for name, param in model.named_parameters())
        return self.vllm

    @torch.no_grad()
    def generate_side(self, model_uri: str, prompts: list, rows: list[dict], labels: list | None) -> dict:
        """Greedy responses, n samples per prompt and what the models say of them, for one side's model."""
        cfg, n = self.cfg, self.cfg.n_samples_per_prompt
        seconds, last = {}, time.perf_counter()

        def lap(part: str) -> None:  # where a side's time goes, for the stage's log line (bench/RESULTS.md reads it)
            nonlocal last
            now = time.perf_counter()
            seconds[part], last = round(now - last, 2), now

        path = resolve_model(model_uri)
        model = self.reference if model_uri == self.baseline_uri else self._load(path)
        pictures = None  # each prompt's images, for a vision-language model
        if self.vision is not None:
            tokenizer, ids, pictures = images.encode_side(path, prompts, rows, cfg)
        else:
            images.refuse_images_for_text(model_uri, rows, cfg)
            tokenizer = load_tokenizer(path)
            ids = [data.encode_prompt(tokenizer, p, cfg.apply_chat_template) for p in prompts]
        with_images = {} if pictures is None else {"images": pictures}
        engine = self._engine(model, tokenizer)
        lap("load")
        greedy = engine.generate(ids, cfg.generate_max_len, greedy=True, **with_images).texts(tokenizer)
        lap("greedy")
        set_seed(cfg.seed)  # every side samples with the same seed
        if pictures is not None:
            with_images = {"images": repeat(pictures, n)}
        sampled = engine.generate(repeat(ids, n), cfg.generate_max_len, temperature=cfg.temperature, **with_images).to(
            "cpu"
        )
        sampled_texts = sampled.texts(tokenizer)
        lap("sampled")
        # the baseline's KL to itself is 0 by definition: no pass
        kl = (
            [0.0] * len(sampled_texts)
            if model is self.reference
            else (
                summed_logprobs(model, sampled, vision=self.vision)
                - summed_logprobs(self.reference, sampled, vision=self.vision)
            ).tolist()
        )
        lap("kl")
        out = {
            "greedy": greedy,
            "sampled": sampled_texts,
            "kl_to_ref": kl,
            "response_length": sampled.response_lengths().float().tolist(),
            "reward_mean": None,
            "episodes": None,
            "lm_eval": None,
            "seconds": seconds,
            "engine": "vLLM" if self.vllm is not None else "transformers",
        }
        if self.reward is not None:
            batch = build_reward_batch(
                sampled, tokenizer, repeat(prompts, n), repeat(labels, n) if labels is not None else None
            )
            out["reward_mean"] = self.reward.score(batch).tolist()
            lap("reward")
        if cfg.env_path:
            out["episodes"] = self._episodes(engine, tokenizer, rows)
            lap("episodes")
        if self.lm_eval is not None:
            out["lm_eval"] = lm_eval_tasks.run_tasks(
                model,
                tokenizer,
                split_list(cfg.lm_eval_tasks),
                self.lm_eval,
                cfg.lm_eval_limit,
                None if cfg.lm_eval_num_fewshot < 0 else cfg.lm_eval_num_fewshot,
                cfg.lm_eval_batch_size,
                cfg.seed,
            )
            lap("lm_eval")
        if model is not self.reference:
            del model
        return out

    def _episodes(self, engine, tokenizer, rows: list[dict]) -> list[dict]:
        """Greedy multi-turn episodes in the environment (--env_path), one per row: their summaries."""
        runner = episode_runner(self.cfg, engine, tokenizer)
        try:
            return runner.run(rows, greedy=True).summaries
        finally:
            runner.close()
