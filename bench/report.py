"""The summary of a results folder: every <dir>/results/<name>.json in one file (bench/results.json), with our
GRPO step at its best micro-batch against TRL's, OpenRLHF's and verl's, the engines' rates, SFT's MFU and the
on/off comparisons (Liger, LoRA, flash-attn, the hf engine), the package versions and the GPU's name.

    python bench/grpo_bench.py report --dir /tmp/bench --out bench/results.json [--command "bash bench/gpu/run.sh ..."]
    python bench/realistic.py collect --dir <results> --into bench/results.json --machine "H100"   # collect_realistic
"""

from __future__ import annotations

import json
import time
from pathlib import Path

from bench.common import COMPLETION_TOKENS, GROUP, PROMPT_TOKENS, PROMPTS_PER_STEP, standard_mfu


def report(bench_dir: Path, out: Path, command: str) -> None:
    import torch

    results = {p.stem: json.loads(p.read_text()) for p in sorted((bench_dir / "results").glob("*.json"))}

    def get(name, key):
        return results.get(name, {}).get(key)

    versions = {}
    for package in ("torch", "transformers", "vllm", "deepspeed", "ray", "trl", "flash_attn"):
        try:
            versions[package] = __import__(package).__version__
        except Exception:  # noqa: BLE001 - absent is a fact to record
            versions[package] = None
    # Ours at its best micro-batch (sequences per forward/backward): the runs differ only in that.
    candidates = sorted(
        (r["step_s"], name)
        for name, r in results.items()
        if name.startswith("ours_vllm")
        and not any(
            k in name for k in ("async", "agentic", "noliger", "lora", "sdpa", "_compile", "_nogc", "_zero", "_1p5b")
        )
    )
    best = candidates[0][1] if candidates else "ours_vllm"
    ours, trl_hf, trl_vllm = get(best, "step_s"), get("trl_hf", "step_s"), get("trl_vllm", "step_s")

    def fastest(peer: str, shape: str = "") -> tuple[float | None, str | None]:
        """A peer's fastest run on the same work at one shape ("" or "_1p5b"): (step seconds, run name)."""
        runs = (
            (r["step_s"], n)
            for n, r in results.items()
            if n.startswith(peer) and n.endswith("_1p5b") == (shape == "_1p5b")
        )
        return min(runs, default=(None, None))

    def ratio(slower: float | None, faster: float | None) -> float | None:
        return round(slower / faster, 3) if slower and faster else None

    openrlhf, openrlhf_run = fastest("openrlhf")  # OpenRLHF 0.11.2 (bench/openrlhf_bench.py)
    verl, verl_run = fastest("verl")  # verl 0.9.1 (bench/verl_bench.py)
    ours_1p5b, trl_vllm_1p5b = get("ours_vllm_m64_1p5b", "step_s"), get("trl_vllm_1p5b", "step_s")
    openrlhf_1p5b, openrlhf_1p5b_run = fastest("openrlhf", "_1p5b")
    verl_1p5b, verl_1p5b_run = fastest("verl", "_1p5b")
    summary = {
        "date": time.strftime("%Y-%m-%d"),
        "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu",
        "command": command,
        "model": json.loads((bench_dir / "model_info.json").read_text()),
        "work": {
            "prompts_per_step": PROMPTS_PER_STEP,
            "group": GROUP,
            "prompt_tokens": PROMPT_TOKENS,
            "completion_tokens": COMPLETION_TOKENS,
            "updates_per_step": 1,
            "kl": "off (beta 0)",
        },
        "grpo_step_s_ours": ours,
        "grpo_step_s_trl": trl_hf,
        "grpo_step_s_trl_vllm": trl_vllm,
        "speedup_vs_trl_vllm": ratio(trl_vllm, ours),
        "speedup_vs_trl_hf": ratio(trl_hf, ours),
        "grpo_step_s_openrlhf": openrlhf,
        "speedup_vs_openrlhf": ratio(openrlhf, ours),
        "grpo_openrlhf_run": openrlhf_run,
        "grpo_step_s_verl": verl,
        "speedup_vs_verl": ratio(verl, ours),
        "grpo_verl_run": verl_run,
        "grpo_ours_run": best,
        "rollout_tokens_per_s": get(best, "rollout_tokens_per_s"),
        "grpo_step_s_ours_2gpu_async": min(
            (r["step_s"] for n, r in results.items() if "async" in n and "agentic" not in n), default=None
        ),
        # agentic_<key> (colocated, one GPU), agentic_separate_<key> and agentic_async_<key> (the engine on a second GPU)
        **{
            f"eval_{engine}_{key}": get(f"eval_{engine}", key)
            for engine in ("vllm", "hf")
            for key in ("side_s", "stage_s", "tokens_per_s")
        },
        **{
            "agentic_" + n.split("_agentic")[1].lstrip("_") + ("_" if n.split("_agentic")[1] else "") + key: r.get(key)
            for n, r in results.items()
            if "_agentic" in n
            for key in (
                "step_s",
                "episodes_per_s",
                "turns_per_episode",
                "time_generate_s",
                "time_train_s",
                "time_weight_sync_s",
            )
        },
        "vllm_standalone_tokens_per_s": get("vllm", "tokens_per_s_64"),
        "hf_generate_tokens_per_s": {
            "dynamic": get("hf_generate", "tokens_per_s_dynamic"),
            "static_compiled": get("hf_generate", "tokens_per_s_static_compiled"),
            "eager": get("hf_generate", "tokens_per_s_eager"),
            "cuda_graphs": get("hf_generate", "tokens_per_s_cuda_graphs"),
            "cuda_graphs_transformers_sdpa": get("hf_generate", "tokens_per_s_cuda_graphs_transformers_sdpa"),
            "cuda_graphs_compiled": get("hf_generate", "tokens_per_s_cuda_graphs_compiled"),
            "cuda_graphs_compiled_fused": get("hf_generate", "tokens_per_s_cuda_graphs_compiled_fused"),
        },
        "vllm_standalone_tokens_per_s_by_batch": {b: get("vllm", f"tokens_per_s_{b}") for b in (64, 256, 1024)},
        "decode_floor_tokens_per_s": get("vllm", "decode_floor_tokens_per_s_64"),
        "decode_floor_tokens_per_s_by_batch": {
            b: get("vllm", f"decode_floor_tokens_per_s_{b}") for b in (64, 256, 1024)
        },
        "sft_mfu": max((r["mfu"] for n, r in results.items() if n in ("sft", "sft_compile")), default=None),
        "sft_mfu_by_run": {n: results[n]["mfu"] for n in ("sft", "sft_compile") if n in results},
        # 6 N + attention, recomputation not counted (standard_flops_per_token); from step_s for runs recorded before it
        "sft_mfu_standard_by_run": {
            n: r.get("mfu_standard") or standard_mfu(bench_dir, r["batch"] * r["seq_len"], r["seq_len"], r["step_s"])
            for n, r in results.items()
            if n.startswith("sft") and "step_s" in r and "seq_len" in r
        },
        "sft_mfu_standard": max(
            (
                r.get("mfu_standard") or standard_mfu(bench_dir, r["batch"] * r["seq_len"], r["seq_len"], r["step_s"])
                for n, r in results.items()
                # without the recomputed forward too: the standard count leaves it out either way
                if n in ("sft", "sft_compile", "sft_nogc", "sft_compile_nogc")
            ),
            default=None,
        ),
        # Liger's kernels and chunked log-probs (the default on CUDA) against the eager kernels and full logits
        "liger_on_off": {
            key: [get(on, field), get(off, field)]
            for key, on, off, field in (
                ("sft_step_s", "sft", "sft_noliger", "step_s"),
                ("sft_gpu_peak_gb", "sft", "sft_noliger", "gpu_peak_gb"),
                ("sft_loss_last", "sft", "sft_noliger", "loss_last"),
                ("grpo_step_s", "ours_vllm_m64", "ours_vllm_m64_noliger", "step_s"),
                ("grpo_train_s", "ours_vllm_m64", "ours_vllm_m64_noliger", "time_train_s"),
            )
        },
        # LoRA (rank 64, every linear layer, the adapter alone synced to vLLM) beside full fine-tuning, same work
        "lora_vs_full": {
            key: [get("ours_vllm_m64_lora64", key), get("ours_vllm_m64", key)]
            for key in ("step_s", "time_generate_s", "time_train_s", "time_weight_sync_s")
        },
        # The 1.5B shape (SHAPE=qwen2.5-1.5b; the runs' names end in _1p5b): the same work, LoRA where it should pay in memory
        "grpo_step_s_ours_1p5b": ours_1p5b,
        "grpo_step_s_trl_vllm_1p5b": trl_vllm_1p5b,
        "speedup_vs_trl_vllm_1p5b": ratio(trl_vllm_1p5b, ours_1p5b),
        "grpo_step_s_openrlhf_1p5b": openrlhf_1p5b,
        "speedup_vs_openrlhf_1p5b": ratio(openrlhf_1p5b, ours_1p5b),
        "grpo_openrlhf_1p5b_run": openrlhf_1p5b_run,
        "grpo_step_s_verl_1p5b": verl_1p5b,
        "speedup_vs_verl_1p5b": ratio(verl_1p5b, ours_1p5b),
        "grpo_verl_1p5b_run": verl_1p5b_run,
        # The hf engine (the actor's own decode loop, its steps replayed as CUDA graphs) in place of vLLM, same work
        **{f"grpo_step_s_ours_hf{shape}": get(f"ours_hf_m64{shape}", "step_s") for shape in ("", "_1p5b")},
        **{
            f"speedup_hf_vs_trl_vllm{shape}": ratio(
                get(f"trl_vllm{shape}", "step_s"), get(f"ours_hf_m64{shape}", "step_s")
            )
            for shape in ("", "_1p5b")
        },
        "lora_vs_full_1p5b": {
            attention: {
                key: [get(f"ours_vllm_m64_lora64{suffix}_1p5b", key), get(f"ours_vllm_m64{suffix}_1p5b", key)]
                for key in ("step_s", "time_generate_s", "time_train_s", "time_weight_sync_s", "train_gpu_peak_gb")
            }
            for attention, suffix in (("flash_attn", ""), ("sdpa", "_sdpa"))
        },
        # FlashAttention-2 (the package built on the machine, bench/gpu/flash_attn.sh) against PyTorch's SDPA, same host
        "flash_vs_sdpa": {
            f"{key}{shape}": [get(run + shape, field), get(run + "_sdpa" + shape, field)]
            for shape in ("", "_1p5b")
            for key, run, field in (
                ("sft_step_s", "sft", "step_s"),
                ("sft_mfu_standard", "sft", "mfu_standard"),
                ("sft_gpu_peak_gb", "sft", "gpu_peak_gb"),
                ("grpo_step_s", "ours_vllm_m64", "step_s"),
                ("grpo_train_s", "ours_vllm_m64", "time_train_s"),
                ("grpo_train_mfu_standard", "ours_vllm_m64", "train_mfu_standard"),
            )
        },
        "versions": versions,
        "runs": results,
    }
    out.write_text(json.dumps(summary, indent=2) + "\n")
    for key in (
        "grpo_step_s_ours",
        "grpo_step_s_trl_vllm",
        "grpo_step_s_trl",
        "grpo_step_s_openrlhf",
        "grpo_step_s_verl",
        "grpo_step_s_ours_1p5b",
        "grpo_step_s_trl_vllm_1p5b",
        "grpo_step_s_openrlhf_1p5b",
        "grpo_step_s_verl_1p5b",
        "rollout_tokens_per_s",
        "vllm_standalone_tokens_per_s",
        "decode_floor_tokens_per_s",
        "sft_mfu",
        "sft_mfu_standard",
    ):
        print(f"{key:32} {summary[key]}")


def collect_realistic(results: Path, into: Path, machine: str, date: str) -> None:
    """Merge results/realistic_<shape>_<system>.json into `into`'s "realistic": {shape: {system: {...}}}, with the
    machine and day they come from (one machine, one day: ratios only within an entry). A run from another day than
    its shape's entry goes in as <system>_<date>, with its own machine and date, and replaces nothing."""
    summary = json.loads(into.read_text())
    realistic = summary.setdefault("realistic", {})
    for path in sorted(results.glob("realistic_*.json")):
        shape_parts = path.stem.removeprefix("realistic_").split("_")
        # shape names have two parts (1p5b_4k) or three (1p5b_lora_4k): the cap part ends in k
        cut = next(i for i, part in enumerate(shape_parts) if part.endswith("k") and part[:-1].isdigit()) + 1
        shape, system = "_".join(shape_parts[:cut]), "_".join(shape_parts[cut:])
        entry, run = realistic.setdefault(shape, {"machine": machine, "date": date}), json.loads(path.read_text())
        if entry["date"] != date:
            system, run = f"{system}_{date.replace('-', '_')}", {**run, "machine": machine, "date": date}
        entry[system] = run
    into.write_text(json.dumps(summary, indent=2) + "\n")
    print(json.dumps({shape: sorted(entry) for shape, entry in realistic.items()}))
