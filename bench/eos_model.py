"""A bench model that stops: EOS with a steady, calibrated per-token hazard (issue 52, item 1).

A random-weight model never emits EOS, so the bench ran with EOS ignored. This engineers a Qwen2 causal LM
(random or real weights, a saved folder or a model in memory) so that at every decode step EOS takes
probability about h whatever the context: lengths are about geometric, mean about 1/h, cut at the cap. One
hidden channel c carries a constant: every token's embedding holds a in c, no layer writes c (o_proj and
down_proj rows c are zero) and no layer reads it (the norms' weight c and the q/k/v/gate/up input columns c
are zero), and the lm_head reads it for EOS alone (column c zero but for EOS, EOS's row zero but for c). Then
EOS's logit is b * a / rms (the final norm's), and no other logit depends on b. The rms varies a little by
position, so `calibrate` measures the hazard on the model's own samples (EOS banned: the continuation given no
EOS yet, the same for any b), p_t(b) = sigmoid(b * u_t / T - logsumexp_{j != EOS}(z_j / T)) with u_t the
normed channel, finds by bisection the b whose expected length E[sum_t prod_{s<t} (1 - p_s)] is the target,
then samples with EOS live and records what came out. Tied embeddings are untied (Qwen2.5-1.5B ties them:
config.tie_word_embeddings becomes false and lm_head.weight is saved on its own), max_position_embeddings
grows to hold prompt + cap, and the folder is a standard Qwen2 safetensors checkpoint with
eos_calibration.json beside it: vLLM, TRL, verl and OpenRLHF load it as is and get the same lengths.

    python -m bench.eos_model --model /tmp/bench/model --out /tmp/bench/model_eos4096 --target_mean 1000 --cap 4096 --temperature 1.0 [--verify_vllm 512]

(or `python bench/grpo_bench.py setup --eos_cap 4096 --eos_mean 1000`, which writes <dir>/model_eos4096 beside <dir>/model).

Sampling is plain: temperature T, top_p 1, top_k off (the saved generation_config says so too). Every system must
sample so: with random weights EOS's logit stands above every other, and top_k 50 would raise its share to about 20% a token. Lengths count
generated tokens, EOS included. With real weights the engineered EOS loses its own logit; other stop ids in
generation_config keep theirs. Training moves channel c's weights a little (Adam, lr 1e-6 in the bench): read the
per-step response lengths.
"""

from __future__ import annotations

import argparse
import gc
import json
import random
import time
from pathlib import Path

import numpy as np
import torch

CALIBRATION_FILE = "eos_calibration.json"
BENCH_TEMPERATURE = (
    1.0  # bench/engine_bench.py's vLLM SamplingParams, the RL stage's --temperature default, TRL's default
)
PROMPT_TOKENS = 128  # the bench's prompts: 128 letters, one token each


def length_stats(lengths, cap: int) -> dict:
    """Response lengths (tokens, EOS included) → mean, median, p90, p99, max and the truncation rate (the share
    that reached the cap: verl's clip ratio)."""
    x = np.asarray(lengths, dtype=np.float64)
    q = np.percentile(x, [50, 90, 99])
    stats = dict(mean=x.mean(), median=q[0], p90=q[1], p99=q[2], max=x.max(), truncation_rate=(x >= cap).mean())
    return {"n": len(x)} | {k: round(float(v), 4) for k, v in stats.items()}


@torch.no_grad()
def engineer(model, eos_id: int, channel: int | None = None, value: float | None = None) -> dict:
    """Reserve hidden channel `channel` of a Qwen2ForCausalLM in place for EOS's logit; returns what was done.
    EOS's logit scale b starts at 0 (EOS logit exactly 0): set_eos_scale sets it, calibrate finds it."""
    m, head = model.model, model.get_output_embeddings()
    embed = m.embed_tokens.weight
    if model.config.tie_word_embeddings or head.weight.data_ptr() == embed.data_ptr():
        head.weight = torch.nn.Parameter(embed.detach().clone())
        model.config.tie_word_embeddings = False
    if channel is None:  # the channel least read at the output and least written at the input
        channel = int(
            (m.norm.weight.float().abs() * head.weight.float().norm(dim=0) * embed.float().norm(dim=0)).argmin()
        )
    c = channel
    if (
        value is None
    ):  # c adds 1% to the embeddings' mean square: the norms scale the rest by 0.5% at layer 0, less after
        value = (0.01 * embed.shape[1]) ** 0.5 * embed.float().pow(2).mean().sqrt().item()
    embed[:, c] = value
    for layer in m.layers:
        for proj in (layer.self_attn.o_proj, layer.mlp.down_proj):  # nothing writes channel c
            proj.weight[c] = 0
            if proj.bias is not None:
                proj.bias[c] = 0
        for proj in (
            layer.self_attn.q_proj,
            layer.self_attn.k_proj,
            layer.self_attn.v_proj,
            layer.mlp.gate_proj,
            layer.mlp.up_proj,
        ):
            proj.weight[:, c] = 0  # nothing reads it
        layer.input_layernorm.weight[c] = layer.post_attention_layernorm.weight[c] = 0
    m.norm.weight[c] = 1
    head.weight[:, c] = 0
    head.weight[eos_id] = 0
    return dict(channel=c, value=value, eos_token_id=eos_id, untied=not model.config.tie_word_embeddings)


@torch.no_grad()
def set_eos_scale(model, eos_id: int, channel: int, b: float) -> float:
    """EOS's logit = b * (normed channel); returns b as the weight's dtype holds it."""
    w = model.get_output_embeddings().weight
    w[eos_id, channel] = b
    return w[eos_id, channel].item()


def _prompt_ids(tokenizer, prompts, n: int) -> torch.Tensor:
    """n prompts of one token length (no padding: generate and the scoring forward see the same positions)."""
    if prompts is None:
        rng = random.Random(0)
        prompts = ["".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(PROMPT_TOKENS)) for _ in range(n)]
    ids = [tokenizer(p, add_special_tokens=False)["input_ids"] for p in prompts]
    width = min(map(len, ids))
    return torch.tensor([ids[i % len(ids)][:width] for i in range(n)])


def _generate(
    model, tokenizer, prompts: torch.Tensor, cap: int, temperature: float, eos_id: int, batch: int, ban_eos: bool
) -> torch.Tensor:
    from transformers import GenerationConfig

    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos_id
    sampling = dict(do_sample=True, temperature=temperature, top_k=0, top_p=1.0, eos_token_id=eos_id, pad_token_id=pad)
    config = GenerationConfig(
        **sampling, max_new_tokens=cap, min_new_tokens=cap if ban_eos else 0
    )  # min_new_tokens: EOS banned
    device = next(model.parameters()).device
    out = [
        model.generate(p.to(device), attention_mask=torch.ones_like(p, device=device), generation_config=config).cpu()
        for p in prompts.split(batch)
    ]
    width = max(o.shape[1] for o in out)
    return torch.cat([torch.nn.functional.pad(o, (0, width - o.shape[1]), value=pad) for o in out])


@torch.no_grad()
def hazard_inputs(
    model, sequences: torch.Tensor, prompt_len: int, eos_id: int, channel: int, temperature: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """For each generated position t of each sequence: u_t (the normed channel, EOS's logit per unit b) and
    logsumexp over every other token of logit / T. Both are (sequences, cap) and independent of b."""
    device, head = next(model.parameters()).device, model.get_output_embeddings()
    us, lses = [], []
    for seq in sequences:
        y = model.model(input_ids=seq[None].to(device), use_cache=False).last_hidden_state[0, prompt_len - 1 : -1]
        us.append(y[:, channel].float().cpu())
        lse = []
        for chunk in y.split(1024):
            z = head(chunk).float() / temperature
            z[:, eos_id] = -float("inf")
            lse.append(z.logsumexp(-1).cpu())
        lses.append(torch.cat(lse))
    return torch.stack(us), torch.stack(lses)


def survival(b: float, u: torch.Tensor, lse: torch.Tensor, temperature: float) -> tuple[torch.Tensor, torch.Tensor]:
    """p_t = P(EOS at t | none before) and S_t = P(length >= t), both (sequences, cap), for scale b."""
    logit = b * u.double() / temperature - lse.double()
    log_q = -torch.nn.functional.softplus(logit)  # log(1 - p)
    s = torch.exp(torch.cumsum(log_q, 1) - log_q)  # S_1 = 1, S_t = prod_{s<t} (1 - p_s)
    return torch.sigmoid(logit), s


def predicted_stats(b: float, u, lse, temperature: float, cap: int) -> dict:
    """The length distribution the hazards give (the mixture over the sampled contexts), in length_stats' terms."""
    p, s = survival(b, u, lse, temperature)
    pmf = (s * p).mean(0)
    pmf[-1] += (s[:, -1] * (1 - p[:, -1])).mean()  # no EOS within the cap: length cap
    cdf = pmf.cumsum(0)
    t = torch.arange(1, cap + 1, dtype=torch.float64)

    def quantile(q):
        return int(torch.searchsorted(cdf, torch.tensor([q], dtype=cdf.dtype)).clamp(max=cap - 1).item()) + 1

    half = cap // 2
    return dict(
        mean=round((pmf * t).sum().item(), 2),
        median=quantile(0.5),
        p90=quantile(0.9),
        p99=quantile(0.99),
        truncation_rate=round((s[:, -1] * (1 - p[:, -1])).mean().item(), 4),
        # the hazard over the contexts the model reached: near-constant over position is the point
        hazard_mean=p.mean().item(),
        hazard_first_half=p[:, :half].mean().item(),
        hazard_second_half=p[:, half:].mean().item(),
        hazard_cv=(p.std() / p.mean()).item(),
    )


def calibrate(
    model,
    tokenizer,
    channel: int,
    target_mean: float,
    temperature: float = BENCH_TEMPERATURE,
    samples: int = 64,
    cap: int = 4096,
    prompts=None,
    verify: int = 128,
    batch: int = 128,
    seed: int = 0,
) -> dict:
    """Set EOS's logit scale b so that sampled responses average `target_mean` tokens (EOS included) under `cap`.
    `samples` responses with EOS banned give the hazards as functions of b; bisection on b; then `verify`
    responses with EOS live measure the lengths. Returns the record saved as eos_calibration.json."""
    eos_id = tokenizer.eos_token_id
    torch.manual_seed(seed)
    t0 = time.time()
    set_eos_scale(model, eos_id, channel, 0.0)
    ids = _prompt_ids(tokenizer, prompts, samples)
    seqs = _generate(model, tokenizer, ids, cap, temperature, eos_id, batch, ban_eos=True)
    u, lse = hazard_inputs(model, seqs, ids.shape[1], eos_id, channel, temperature)
    t_hazards = time.time() - t0

    def mean_length(b):
        return survival(b, u, lse, temperature)[1].sum(1).mean().item()

    if not mean_length(0.0) > target_mean:
        raise ValueError(
            f"even with b = 0 the mean length ({mean_length(0.0):.1f}) is not above the target {target_mean}"
        )
    lo, hi = 0.0, 1.0
    while mean_length(hi) > target_mean:
        lo, hi = hi, hi * 2
    for _ in range(60):  # the mean length falls as b grows
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if mean_length(mid) > target_mean else (lo, mid)
    b = set_eos_scale(model, eos_id, channel, (lo + hi) / 2)  # rounded to the weights' dtype: predict with that
    record = dict(
        b=b,
        channel=channel,
        eos_token_id=eos_id,
        target_mean=target_mean,
        cap=cap,
        sampling=dict(temperature=temperature, top_p=1.0, top_k=0, prompt_tokens=int(ids.shape[1])),
        calibration_samples=samples,
        predicted=predicted_stats(b, u, lse, temperature, cap),
        seconds=dict(hazards=round(t_hazards, 1)),
    )
    if verify:
        t1 = time.time()
        ids = _prompt_ids(tokenizer, prompts, verify)
        out = _generate(model, tokenizer, ids, cap, temperature, eos_id, batch, ban_eos=False)[:, ids.shape[1] :]
        hit = out == eos_id
        lengths = torch.where(hit.any(1), hit.int().argmax(1) + 1, torch.full((len(out),), cap))
        record["measured"] = length_stats(lengths.tolist(), cap)
        record["seconds"]["verify"] = round(time.time() - t1, 1)
    return record


def vllm_lengths(model_dir, prompts: torch.Tensor, cap: int, temperature: float, seed: int = 0) -> list[int]:
    """The same sampling through vLLM, from the saved folder: what vLLM-based systems (ours, TRL, verl, OpenRLHF) get."""
    from vllm import LLM, SamplingParams

    llm = LLM(
        model=str(model_dir),
        dtype="bfloat16",
        gpu_memory_utilization=0.5,
        max_model_len=prompts.shape[1] + cap,
        seed=seed,
    )
    params = SamplingParams(temperature=temperature, top_p=1.0, max_tokens=cap, detokenize=False)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts.tolist()], params, use_tqdm=False)
    return [len(o.outputs[0].token_ids) for o in outs]  # EOS included, as HF's lengths here


def build(
    model_dir,
    out_dir,
    target_mean: float,
    cap: int,
    temperature: float = BENCH_TEMPERATURE,
    prompts_file=None,
    verify_vllm: int = 0,
    **kwargs,
) -> dict:
    """Load a saved model, engineer it, calibrate it (on the GPU if there is one) and save the model, its
    tokenizer and eos_calibration.json to out_dir; with verify_vllm, then sample that many responses through vLLM."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gpu = torch.cuda.is_available()
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = (
        AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16 if gpu else torch.float32)
        .to("cuda" if gpu else "cpu")
        .eval()
    )
    done = engineer(model, tokenizer.eos_token_id, kwargs.pop("channel", None))
    prompts = None
    if prompts_file and Path(prompts_file).exists():
        prompts = [json.loads(line)["prompt"] for line in Path(prompts_file).read_text().splitlines() if line.strip()]
    scale = kwargs.pop("scale", None)
    if scale is None:
        record = calibrate(
            model, tokenizer, done["channel"], target_mean, temperature, cap=cap, prompts=prompts, **kwargs
        )
    else:  # an earlier calibration's b for the same weights (same seed and shape): no sampling
        b = set_eos_scale(model, tokenizer.eos_token_id, done["channel"], scale)
        record = dict(
            b=b,
            channel=done["channel"],
            eos_token_id=tokenizer.eos_token_id,
            target_mean=target_mean,
            cap=cap,
            given_scale=True,
        )
        record.update(
            sampling=dict(temperature=temperature, top_p=1.0, top_k=0, prompt_tokens=PROMPT_TOKENS), seconds={}
        )
    record.update(
        value=model.model.embed_tokens.weight[0, done["channel"]].item(),
        untied_embeddings=done["untied"],
        source=str(model_dir),
    )
    record.update(device=torch.cuda.get_device_name() if gpu else "cpu", dtype=str(model.dtype).removeprefix("torch."))
    need = record["sampling"]["prompt_tokens"] + cap  # vLLM refuses a max_model_len past max_position_embeddings
    if model.config.max_position_embeddings < need:
        model.config.max_position_embeddings = tokenizer.model_max_length = -(-need // 256) * 256
    g = model.generation_config  # HF generate's defaults become the calibrated sampling (its own top_k is 50)
    g.do_sample, g.temperature, g.top_k, g.top_p = True, temperature, 0, 1.0
    out_dir = Path(out_dir)
    model.save_pretrained(out_dir, safe_serialization=True)
    tokenizer.save_pretrained(out_dir)
    (out_dir / CALIBRATION_FILE).write_text(json.dumps(record, indent=2) + "\n")
    if verify_vllm:  # the GPU to vLLM: this model goes first
        del model
        gc.collect()
        torch.cuda.empty_cache()
        t = time.time()
        lengths = vllm_lengths(
            out_dir, _prompt_ids(tokenizer, prompts, verify_vllm), cap, temperature, kwargs.get("seed", 0)
        )
        record["measured_vllm"] = length_stats(lengths, cap)
        record["seconds"]["verify_vllm"] = round(time.time() - t, 1)
        (out_dir / CALIBRATION_FILE).write_text(json.dumps(record, indent=2) + "\n")
    return record


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, required=True, help="a saved Qwen2 causal LM (and its tokenizer)")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--target_mean", type=float, default=1000)
    parser.add_argument("--cap", type=int, default=4096, help="max new tokens")
    parser.add_argument("--temperature", type=float, default=BENCH_TEMPERATURE)
    parser.add_argument(
        "--prompts",
        type=Path,
        help="jsonl with a 'prompt' field; default: prompts.jsonl beside --model, else 128 random letters",
    )
    parser.add_argument(
        "--samples", type=int, default=64, help="responses (EOS banned, cap tokens each) the hazards are measured on"
    )
    parser.add_argument(
        "--verify", type=int, default=128, help="responses sampled with EOS live to measure the lengths (0: none)"
    )
    parser.add_argument(
        "--verify_vllm",
        type=int,
        default=0,
        help="then sample this many through vLLM from the saved folder (GPU, vllm installed)",
    )
    parser.add_argument("--batch", type=int, default=128, help="sequences per generate call")
    parser.add_argument("--channel", type=int, help="hidden channel to reserve (default: the least used)")
    parser.add_argument(
        "--scale",
        type=float,
        help="EOS's logit scale b from an earlier calibration of the same weights (with --channel): no calibration",
    )
    a = parser.parse_args()
    prompts = a.prompts or a.model.parent / "prompts.jsonl"
    record = build(
        a.model,
        a.out,
        a.target_mean,
        a.cap,
        a.temperature,
        prompts,
        a.verify_vllm,
        samples=a.samples,
        verify=a.verify,
        batch=a.batch,
        channel=a.channel,
        scale=a.scale,
    )
    print(json.dumps(record, indent=2), flush=True)


if __name__ == "__main__":
    main()
