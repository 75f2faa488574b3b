"""The stages on a GPU (marked gpu: skipped without CUDA and vllm; run on the GPU machine with
`bash bench/gpu/run.sh tests_stages`, see bench/gpu/README.md).

- Every stage's CLI on the demo model with the GPU path's flags: bf16, ZeRO-2 and ZeRO-3,
  --adam_offload, gradient checkpointing, Liger's kernels (on by default on CUDA), --flash_attn (SDPA
  when flash-attn is missing, said in the log), --packing_samples in SFT and the reward model,
  --torch_compile in SFT, and PPO with its rollouts
  from a vLLM engine colocated with every model (sleep/wake), synced after each update and checked
  against the actor's log-probabilities.
- Liger's kernels and the chunked log-probabilities against the eager path: loss and gradients; SFT's loss
  through Liger's fused linear cross-entropy against the eager one, rows padded and packed; the compiled
  passes over the vocabulary (log-probabilities, entropy, the decode's sampling) against eager float32.
- FlashAttention-2's varlen packing against SDPA per sequence: log-probabilities and gradients (when
  flash-attn is installed: bench/gpu/flash_attn.sh builds it).
- RL with LoRA and vLLM: the engine is synced the adapter alone and follows the trained policy.
- The hf engine's decode steps replayed as CUDA graphs against eager ones, and GRPO with it in place of vLLM.
- The demo task's learning check on the GPU path, as tests/e2e/test_learning.py runs it on the CPU: GRPO
  (group_norm, KL off, one update per rollout) with the terse-style reward against the zero-reward
  control, the rollouts from vLLM. On-policy with the engine in the actor on one GPU, the same with LoRA
  and, when a second GPU is there, one step off-policy (--async_train) with the engine on the other.

Outputs go to local folders; the Ray head is RAY_ADDRESS's (bench/gpu/env.sh's start_ray) or one
started here.
"""

import importlib.util
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time

import pytest
import torch

from tasks.common import manifest as manifests

from tests.conftest import REPO, SCRATCH, free_port
from tests.e2e.test_stages import cli_env, flags

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not (torch.cuda.is_available() and importlib.util.find_spec("vllm")), reason="needs a CUDA GPU and vllm"
    ),
]

ROOT = SCRATCH / "gpu"
GPU_FLAGS = {"bf16": True, "flash_attn": True, "gradient_checkpointing": True}
STYLE = {"remote_rm_url": str(REPO / "tests" / "rewards" / "style_reward.py")}
CONTROL = {"remote_rm_url": str(REPO / "tests" / "rewards" / "zero_reward.py")}
GRPO = {
    "advantage_estimator": "group_norm",
    "rollout_batch_size": 32,
    "n_samples_per_prompt": 4,
    "train_batch_size": 128,
    "max_epochs": 1,
    "init_kl_coef": 0.0,
    "max_steps": 30,
    "vllm_num_engines": 1,
}


@pytest.fixture(scope="module")
def gpu_ray():
    """RAY_ADDRESS's head, or a `ray start --head --block` on loopback with every GPU, stopped afterwards."""
    if os.environ.get("RAY_ADDRESS"):
        yield os.environ["RAY_ADDRESS"]
        return
    port = free_port()
    temp = tempfile.mkdtemp(prefix="rlhf-gpu-ray-")
    proc = subprocess.Popen(
        # The CLI through this python: a `ray` script on PATH may carry another interpreter's shebang.
        [
            sys.executable,
            "-m",
            "ray.scripts.scripts",
            "start",
            "--head",
            "--block",
            "--node-ip-address",
            "127.0.0.1",
            f"--port={port}",
            f"--temp-dir={temp}",
            f"--num-gpus={torch.cuda.device_count()}",
            "--include-dashboard=false",
            "--disable-usage-stats",
        ],
        env={**os.environ, "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"},
        start_new_session=True,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    deadline = time.time() + 120
    while time.time() < deadline:
        if proc.poll() is not None:
            pytest.fail(
                f"ray start exited with {proc.returncode}: run `ray start --head` by hand to see why", pytrace=False
            )
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                break
        time.sleep(1)
    time.sleep(5)  # the GCS port opens before the raylet registers
    yield f"127.0.0.1:{port}"
    os.killpg(proc.pid, signal.SIGTERM)
    proc.wait(timeout=60)
    shutil.rmtree(temp, ignore_errors=True)


def cli(ray: str, module: str, **values) -> str:
    """A stage's CLI, its output echoed as it comes (with -s): a device call cut off by its time limit then
    still shows which stage it was in and how far that stage got."""
    start, lines = time.time(), []
    with subprocess.Popen(
        [sys.executable, "-m", module, *flags(values)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=cli_env(ray),
        cwd=REPO,
    ) as proc:
        for line in proc.stdout:
            print(f"[{module}] {line}", end="", flush=True)
            lines.append(line)
    print(f"[{module}] exit {proc.returncode} after {time.time() - start:.0f} s", flush=True)
    log = "".join(lines)
    assert proc.returncode == 0, f"{module} failed:\n{log[-6000:]}"
    return log


def metrics(uri: str) -> list[dict]:
    path, _ = manifests.fetch(uri, ROOT / "fetched" / os.path.basename(uri))
    return [json.loads(line) for line in (path / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def data():
    from tasks.common import stage
    from tasks.common.config import make_config
    from tasks.data.__main__ import prepare
    from tasks.data.config import PrepareDataConfig

    shutil.rmtree(ROOT, ignore_errors=True)
    out = str(ROOT / "data")
    stage.run("prepare_data", make_config(PrepareDataConfig, {"output": out}), prepare)
    return out


def test_every_stage_runs_on_the_gpu_path(gpu_ray, data):
    out = {name: str(ROOT / name) for name in ("sft", "rm", "ppo", "dpo", "eval")}
    log = cli(
        gpu_ray,
        "tasks.sft",
        output=out["sft"],
        pretrain=data,
        dataset=data,
        max_steps=20,
        zero_stage=2,
        packing_samples=True,
        torch_compile=True,
        **GPU_FLAGS,
    )
    if importlib.util.find_spec("flash_attn") is None:
        assert "flash_attn:" in log  # the fallback to SDPA is said
    cli(
        gpu_ray,
        "tasks.reward_model",
        output=out["rm"],
        pretrain=out["sft"],
        dataset=data,
        max_steps=10,
        zero_stage=3,
        adam_offload=True,
        packing_samples=True,
        **GPU_FLAGS,
    )
    # PPO with a critic, every model and the vLLM engine on one GPU; ZeRO-3, so each sync gathers the shards.
    cli(
        gpu_ray,
        "tasks.rl",
        output=out["ppo"],
        pretrain=out["sft"],
        reward_pretrain=out["rm"],
        prompt_data=data,
        max_steps=3,
        rollout_batch_size=16,
        train_batch_size=8,
        colocate_all_models=True,
        vllm_num_engines=1,
        vllm_gpu_memory_utilization=0.2,
        vllm_enable_sleep=True,
        zero_stage=3,
        **GPU_FLAGS,
    )
    cli(
        gpu_ray,
        "tasks.preference",
        output=out["dpo"],
        pretrain=out["sft"],
        dataset=data,
        method="dpo",
        dataset_split="style_pairs",
        max_steps=5,
        zero_stage=2,
        **GPU_FLAGS,
    )
    cli(
        gpu_ray,
        "tasks.eval",
        output=out["eval"],
        baseline=out["sft"],
        policy=out["ppo"],
        reward_pretrain=out["rm"],
        dataset=data,
        max_samples=64,
        metric_func="tasks/data/demo_metrics.py",
    )
    for name in out:
        assert manifests.read_manifest(out[name])  # committed
    logged = metrics(out["ppo"])
    gaps = [r["engine_logprob_max_diff"] for r in logged]
    print(f"ppo on the gpu: engine vs actor log-probability gap per step {gaps}")
    assert len(gaps) == 3 and max(gaps) < 0.25  # bf16 noise, not stale weights
    assert all("value_loss" in r for r in logged)


def test_liger_kernels_give_the_eager_loss_and_gradients():
    """The demo model loaded with Liger (its RMSNorm, SwiGLU and RoPE kernels, log-probs a chunk of tokens at a
    time) against the same weights loaded eager, in float32 on the GPU: an SFT-style loss with an entropy term
    at a sampling temperature, and every parameter's gradient."""
    from tasks.common.nn import data as batches
    from tasks.common.nn.models import load_causal_lm, sequence_logprobs, use_liger
    from tasks.data import demo

    assert use_liger(True), "liger-kernel is missing: the gpu extra installs it"
    tok = demo.build_tokenizer()
    path = ROOT / "liger-base"
    demo.build_base_model(tok, seed=1).save_pretrained(path)
    tok.save_pretrained(path)
    ids, mask = batches.pad(
        [batches.encode_prompt(tok, p) for p in ("3+4=7", "37+45=82", "1+1=2 is the sum")],
        tok.pad_token_id,
        side="left",
    )
    ids, mask = ids.cuda(), mask.cuda()
    runs = []
    for liger in (False, True):  # eager first: Liger's RoPE replaces the architecture's function for the process
        model = load_causal_lm(str(path), liger=liger).cuda()
        logprobs, entropy = sequence_logprobs(model, ids, mask, return_entropy=True, temperature=0.9)
        loss = -(logprobs * mask[:, 1:]).sum() / mask[:, 1:].sum() - 0.01 * (entropy * mask[:, 1:]).mean()
        loss.backward()
        runs.append((loss.item(), {name: p.grad.float().cpu() for name, p in model.named_parameters()}))
    (eager_loss, eager_grads), (liger_loss, liger_grads) = runs
    print(f"liger: loss {liger_loss:.6f} against eager {eager_loss:.6f}")
    assert abs(liger_loss - eager_loss) < 1e-4
    for name, grad in eager_grads.items():
        assert torch.allclose(liger_grads[name], grad, rtol=1e-3, atol=1e-5), name


def test_sft_loss_through_ligers_fused_linear_cross_entropy_gives_the_eager_loss_and_gradients():
    """SFT's loss on the GPU with Liger comes from Liger's fused linear cross-entropy (the head's gradients taken in
    the forward pass): against the same weights loaded eager, in float32, rows padded and packed, the same loss
    and every parameter's gradient."""
    from tasks.common.nn import data as batches
    from tasks.common.nn.models import load_causal_lm, token_nll_sum, use_liger
    from tasks.common.nn.supervised import micro_batch_inputs, micro_batch_loss
    from tasks.data import demo

    assert use_liger(True), "liger-kernel is missing: the gpu extra installs it"
    tok = demo.build_tokenizer()
    path = ROOT / "fused-ce-base"
    demo.build_base_model(tok, seed=2).save_pretrained(path)
    tok.save_pretrained(path)
    rows = [("12+34=", "046"), ("05+05=", "010 is the sum"), ("99+01=", "100")]
    ids = [batches.encode_prompt(tok, p) + batches.encode_response(tok, r) for p, r in rows]
    masks = [[0] * len(batches.encode_prompt(tok, p)) + [1] * len(batches.encode_response(tok, r)) for p, r in rows]
    device = torch.device("cuda")
    input_ids, positions, attention_mask, loss_mask = micro_batch_inputs(ids, masks, tok.pad_token_id, False, device)
    runs = {}
    for liger in (False, True):  # eager first: Liger's RoPE replaces the architecture's function for the process
        model = load_causal_lm(str(path), liger=liger).to(device)
        fused = token_nll_sum(model, input_ids, loss_mask[:, 1:], positions, attention_mask)
        assert (fused is not None) == liger  # the fused kernel runs exactly when Liger is on
        for packed in (False, True):
            model.zero_grad()
            loss = micro_batch_loss(model, ids, masks, tok.pad_token_id, packed, device, 7.0)
            loss.backward()
            runs[liger, packed] = (loss.item(), {name: p.grad.float().cpu() for name, p in model.named_parameters()})
    for packed in (False, True):
        (eager_loss, eager_grads), (fused_loss, fused_grads) = runs[False, packed], runs[True, packed]
        print(f"fused cross-entropy, packed={packed}: loss {fused_loss:.6f} against eager {eager_loss:.6f}")
        assert abs(fused_loss - eager_loss) < 1e-4
        for name, grad in eager_grads.items():
            assert torch.allclose(fused_grads[name], grad, rtol=1e-3, atol=1e-5), name


def test_the_compiled_vocabulary_passes_give_the_eager_numbers():
    """On CUDA the passes over the vocabulary run compiled: head_logprobs' log-probabilities and entropy (RL's
    training and scoring) and sample_next's exponential race (the hf engine's decode). Against eager float32
    log-softmax on the same bf16 logits of a 152k vocabulary: values, the entropy in autograd and out of it, the
    gradients to the hidden states and the head; the race's draws follow the tempered softmax."""
    from tasks.common.nn.engines.hf_engine import sample_next
    from tasks.common.nn.vocab import head_logprobs

    torch.manual_seed(0)
    device, vocab = torch.device("cuda"), 151936
    hidden = torch.randn(2, 300, 64, device=device, dtype=torch.bfloat16, requires_grad=True)
    head = torch.nn.Linear(64, vocab, bias=False, device=device, dtype=torch.bfloat16)
    labels = torch.randint(0, vocab, (2, 300), device=device)
    w1, w2 = torch.randn(2, 300, device=device), torch.randn(2, 300, device=device)

    def eager():
        log_p = torch.log_softmax(head(hidden).float() / 0.9, -1)
        return log_p.gather(-1, labels[..., None]).squeeze(-1), -(log_p.exp() * log_p).sum(-1)

    runs = []
    for fn in (eager, lambda: head_logprobs(hidden, head, labels, 0.9, return_entropy=True, chunk_tokens=256)):
        logprobs, entropy = fn()
        grads = torch.autograd.grad((logprobs * w1 + entropy * w2).sum(), [hidden, head.weight])
        runs.append((logprobs, entropy, *grads))
    for name, want, got in zip(("log-probs", "entropy", "hidden grad", "head grad"), *runs):
        error = ((got.float() - want.float()).norm() / want.float().norm()).item()
        print(f"compiled {name}: relative error {error:.1e}")
        assert error < (1e-5 if name in ("log-probs", "entropy") else 1e-2), name
    logprobs, entropy = head_logprobs(hidden, head, labels, 0.9, return_entropy=True, entropy_grad=False)
    assert logprobs.requires_grad and not entropy.requires_grad

    logits = torch.log(torch.tensor([0.5, 0.3, 0.2], device=device)).repeat(200000, 1)
    token, logprob = sample_next(logits, temperature=0.5)
    tempered = torch.tensor([0.25, 0.09, 0.04], device=device) / 0.38
    assert torch.allclose(torch.bincount(token, minlength=3) / 200000, tempered, atol=0.005)
    assert torch.allclose(logprob, tempered.log()[token], atol=1e-5)
    token, logprob = sample_next(logits[:2].to(torch.bfloat16), temperature=0.5, greedy=True)
    assert token.tolist() == [0, 0] and torch.allclose(
        logprob, torch.log_softmax(logits[:2].to(torch.bfloat16).float(), -1)[:, 0]
    )


def test_flash_attn_packed_rows_give_each_sequences_own_logprobs_and_gradients():
    """FlashAttention-2's varlen path (sequences packed in one row, boundaries from the restarting position ids,
    no mask) against SDPA on the same sequences padded one per row, in bf16 on the GPU: the log-probabilities
    of every real token, and the gradient of their sum."""
    if importlib.util.find_spec("flash_attn") is None:
        pytest.skip("flash-attn is not installed (bench/gpu/flash_attn.sh builds it)")
    from tasks.common.nn import data as batches
    from tasks.common.nn.models import load_causal_lm, sequence_logprobs
    from tasks.common.nn.packed import packed_logprobs
    from tasks.data import demo

    tok = demo.build_tokenizer()
    path = ROOT / "flash-base"
    demo.build_base_model(tok, seed=2).save_pretrained(path)
    tok.save_pretrained(path)
    seqs = [batches.encode_prompt(tok, p) for p in ("3+4=7", "37+45=82 is the sum", "1+1=2", "90+10=100")]
    runs = []
    for flash in (False, True):
        model = load_causal_lm(str(path), dtype=torch.bfloat16, flash_attn=flash).cuda()
        assert model.config._attn_implementation == ("flash_attention_2" if flash else "sdpa")
        if flash:
            ids, positions, index = batches.pack(seqs)
            row = packed_logprobs(model, ids.cuda(), positions.cuda(), index.cuda())[0]
            starts = [0] + [sum(len(s) for s in seqs[:k]) for k in range(1, len(seqs))]
            per_seq = [row[start : start + len(s) - 1] for start, s in zip(starts, seqs)]  # each sequence's own tokens
        else:
            ids, mask = batches.pad(seqs, tok.pad_token_id)
            logprobs = sequence_logprobs(model, ids.cuda(), mask.cuda())
            per_seq = [logprobs[k, : len(s) - 1] for k, s in enumerate(seqs)]
        total = torch.cat(per_seq).float().sum()
        total.backward()
        runs.append(
            (torch.cat(per_seq).float().detach().cpu(), {n: p.grad.float().cpu() for n, p in model.named_parameters()})
        )
    (sdpa, sdpa_grads), (flash, flash_grads) = runs
    print(f"flash-attn varlen against sdpa: max log-prob gap {(flash - sdpa).abs().max().item():.4f}")
    assert torch.allclose(flash, sdpa, atol=0.05)  # bf16 kernels of different accumulation orders
    for name, grad in sdpa_grads.items():
        assert torch.allclose(flash_grads[name], grad, rtol=0.05, atol=0.05 * grad.abs().max().item() + 1e-3), name


def test_flash_attn_packed_rl_passes_give_the_padded_response_logprobs_and_gradients():
    """RL's --packing_samples on the GPU: a rollout batch (prompts left-padded, responses right-padded) run as one
    varlen row on FlashAttention-2 against the same batch padded on SDPA, in bf16: every response token's
    log-probability and entropy, and the gradient of their sum, through the Liger-chunked head the actor uses."""
    if importlib.util.find_spec("flash_attn") is None:
        pytest.skip("flash-attn is not installed (bench/gpu/flash_attn.sh builds it)")
    from tasks.common.nn import data as batches
    from tasks.common.nn.models import load_causal_lm
    from tasks.data import demo
    from tasks.rl.experience import response_logprobs

    tok = demo.build_tokenizer()
    path = ROOT / "flash-rl-base"
    demo.build_base_model(tok, seed=3).save_pretrained(path)
    tok.save_pretrained(path)
    prompts = [batches.encode_prompt(tok, p) for p in ("3+4=", "37+45=", "1+1=", "90+10=")]
    responses = [batches.encode_response(tok, r) for r in ("7", "082 is the sum", "002", "100 is")]
    width = max(map(len, prompts))
    ids, mask = batches.pad([[tok.pad_token_id] * (width - len(p)) + p + r for p, r in zip(prompts, responses)], 0)
    mask = mask * (ids != tok.pad_token_id)  # the prompts' left padding is padding too
    live = mask[:, width:].bool()
    runs = []
    for flash in (False, True):
        model = load_causal_lm(str(path), dtype=torch.bfloat16, flash_attn=flash, liger=True).cuda()
        logprobs, entropy = response_logprobs(
            model, ids.cuda(), mask.cuda(), width, return_entropy=True, temperature=0.7, packed=flash
        )
        logprobs, entropy = logprobs[live.cuda()].float(), entropy[live.cuda()].float()
        logprobs.sum().backward()
        grads = {n: p.grad.float().cpu() for n, p in model.named_parameters() if p.grad is not None}
        runs.append((logprobs.detach().cpu(), entropy.cpu(), grads))
    (lp, ent, grads), (packed_lp, packed_ent, packed_grads) = runs
    print(f"packed flash-attn against padded sdpa: max log-prob gap {(packed_lp - lp).abs().max().item():.4f}")
    assert torch.allclose(packed_lp, lp, atol=0.05) and torch.allclose(packed_ent, ent, atol=0.05)
    assert grads.keys() == packed_grads.keys()
    for name, grad in grads.items():
        assert torch.allclose(packed_grads[name], grad, rtol=0.05, atol=0.05 * grad.abs().max().item() + 1e-3), name


def test_the_decode_loop_replayed_as_cuda_graphs_matches_the_eager_one_and_reads_updated_weights_in_place(caplog):
    """The hf engine's CUDA path (each decode step captured once as a CUDA graph, then replayed; SDPA while
    decoding) on a model loaded as the actor is (Liger, flash-attn for training): in float32 its greedy tokens
    and log-probabilities equal the eager steps', before and after an in-place weight update (the graphs read
    the weights in place), and so are those of the --torch_compile path (the decode forward compiled, the sibling
    projections fused); its sampled tokens' log-probabilities are the trainer's at the temperature."""
    from tasks.common.nn import data as batches
    from tasks.common.nn.engines.hf_engine import HFRolloutEngine
    from tasks.common.nn.models import load_causal_lm
    from tasks.data import demo
    from tasks.rl.experience import response_logprobs

    tok = demo.build_tokenizer()
    path = ROOT / "decode-base"
    demo.build_base_model(tok, seed=6).save_pretrained(path)
    tok.save_pretrained(path)
    prompts = [batches.encode_prompt(tok, p) for p in ("3+4=", "37+45=", "1+99=", "12+3=4+5+6+7+8=")]
    device = torch.device("cuda")
    model = load_causal_lm(str(path), dtype=torch.float32, flash_attn=True, liger=True).to(device)
    training_attention = model.config._attn_implementation  # flash_attention_2, or sdpa where flash-attn is missing
    graphs, eager = HFRolloutEngine(model, tok, device, cuda_graphs=True), HFRolloutEngine(model, tok, device)
    compiled = HFRolloutEngine(model, tok, device, cuda_graphs=True, compile_decode=True, fuse_projections=True)
    for update in range(2):
        a, b, c = (e.generate(prompts, max_new_tokens=24, greedy=True) for e in (graphs, eager, compiled))
        extra = a.prompt_width - b.prompt_width
        for fast in (a, c):
            assert torch.equal(fast.sequences[:, extra:], b.sequences.to(fast.sequences.device)), (
                f"after {update} updates"
            )
            assert torch.allclose(fast.logprobs, b.logprobs, atol=1e-4)
        assert a.texts(tok) == a.to("cpu").texts(tok)  # decoded where the engine left them (eval decodes on the GPU)
        with torch.no_grad():  # an optimizer step's way: the same tensors, new values
            for p in model.parameters():
                p.mul_(1.05)
    assert model.config._attn_implementation == training_attention  # restored for training
    assert graphs.captured() and compiled.captured(), caplog.text  # replayed, not run eagerly
    torch.manual_seed(0)
    rollout = graphs.generate(prompts * 8, max_new_tokens=24, temperature=0.7)
    model.set_attn_implementation("sdpa")  # flash-attn takes half precision only; this float32 check compares at 1e-3
    trainer = response_logprobs(
        model, rollout.sequences.to(device), rollout.attention_mask.to(device), rollout.prompt_width, temperature=0.7
    ).cpu()
    gap = ((trainer - rollout.logprobs.cpu()).abs() * rollout.response_mask.cpu()).max().item()
    print(f"decode steps as CUDA graphs: sampled tokens' log-prob gap to the trainer's {gap:.2e}")
    assert gap < 1e-3
    again = graphs.generate(prompts * 8, max_new_tokens=24, temperature=0.7)  # the replays draw new noise
    assert not torch.equal(again.sequences, rollout.sequences)


def test_the_flash_kvcache_decode_attention_matches_sdpa_and_decodes_as_the_trainer_scores():
    """flash-attn's kv-cache kernel in the decode step (what a model trained with --flash_attn decodes with, in
    bf16): over a cache with left padding and unwritten slots it gives packed SDPA's output, compiled in one graph
    too; and an engine using it, its steps compiled and replayed, samples tokens whose log-probabilities are the
    trainer's as closely as the SDPA engine's are."""
    if importlib.util.find_spec("flash_attn") is None:
        pytest.skip("flash-attn is not installed (bench/gpu/flash_attn.sh builds it)")
    from types import SimpleNamespace

    from tasks.common.nn import data as batches
    from tasks.common.nn.engines.hf_engine import (
        DECODE_ATTENTION,
        FLASH_DECODE_ATTENTION,
        HFRolloutEngine,
        flash_kvcache_attention,
        packed_gqa_sdpa,
    )
    from tasks.common.nn.models import load_causal_lm
    from tasks.data import demo
    from tasks.rl.experience import response_logprobs

    torch.manual_seed(0)
    heads, kv, length, dim = 12, 2, 96, 128
    module = SimpleNamespace(num_key_value_groups=heads // kv)
    q = torch.randn(5, heads, 1, dim, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(5, kv, length, dim, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    mask = torch.zeros(5, 1, 1, length, dtype=torch.bool, device="cuda")
    for row, (start, end) in enumerate(
        [(0, 50), (3, 50), (17, 50), (0, 96), (40, 70)]
    ):  # left padding, then written slots
        mask[row, ..., start:end] = True
    want, _ = packed_gqa_sdpa(module, q, k, v, mask, scaling=dim**-0.5)
    got, _ = flash_kvcache_attention(module, q, k, v, mask, scaling=dim**-0.5)
    assert got.shape == want.shape and torch.allclose(got.float(), want.float(), atol=2e-2)
    compiled, _ = torch.compile(flash_kvcache_attention, fullgraph=True)(module, q, k, v, mask, scaling=dim**-0.5)
    assert torch.allclose(compiled.float(), want.float(), atol=2e-2)

    tok = demo.build_tokenizer()
    path = ROOT / "flash-decode-base"
    demo.build_base_model(tok, seed=6).save_pretrained(path)
    tok.save_pretrained(path)
    prompts = [batches.encode_prompt(tok, p) for p in ("3+4=", "37+45=", "1+99=", "12+3=4+5+6+7+8=")] * 4
    model = load_causal_lm(str(path), dtype=torch.bfloat16, flash_attn=True).cuda()
    gaps = {}
    for attention in (FLASH_DECODE_ATTENTION, DECODE_ATTENTION):
        engine = HFRolloutEngine(
            model, tok, torch.device("cuda"), cuda_graphs=True, compile_decode=True, fuse_projections=True
        )
        assert engine.decode_attention == FLASH_DECODE_ATTENTION  # the model trains with flash-attn
        engine.decode_attention = attention
        torch.manual_seed(0)
        rollout = engine.generate(prompts, max_new_tokens=24, temperature=0.7)
        assert engine.captured()
        trainer = response_logprobs(
            model, rollout.sequences.cuda(), rollout.attention_mask.cuda(), rollout.prompt_width, temperature=0.7
        ).cpu()
        gaps[attention] = ((trainer.float() - rollout.logprobs.cpu()).abs() * rollout.response_mask.cpu()).max().item()
    print(f"bf16 decode: sampled tokens' log-prob gap to the trainer's {gaps}")
    assert gaps[FLASH_DECODE_ATTENTION] <= 2 * gaps[DECODE_ATTENTION] + 1e-2


def test_rl_with_the_hf_engine_on_the_gpu(gpu_ray, data):
    """GRPO with rollouts from the actor's own decode loop, its steps replayed as CUDA graphs (no vLLM): the engine reads the trained
    weights in place, so its log-probabilities stay the actor's step after step."""
    out = str(ROOT / "grpo-hf")
    cli(
        gpu_ray,
        "tasks.rl",
        output=out,
        pretrain=data,
        prompt_data=data,
        **{**GRPO, **STYLE, "vllm_num_engines": 0, "max_steps": 4},
        **GPU_FLAGS,
    )
    gaps = [r["engine_logprob_max_diff"] for r in metrics(out)]
    print(f"grpo with the hf engine: engine vs actor log-probability gap per step {gaps}")
    assert len(gaps) == 4 and max(gaps) < 0.25


def test_rl_with_lora_hands_vllm_the_adapter_alone_and_its_rollouts_follow_it(gpu_ray, data):
    """LoRA with vLLM rollouts, colocated (and, with a second GPU, the engine on its own a step ahead): each
    update hands the engine the adapter alone, and the engine's sampled log-probabilities stay the trained
    policy's (the sync check, every step) while the policy moves well away from its base (the KL to the base,
    the reference under LoRA), at a learning rate chosen to move it far in a few steps."""
    sft = str(ROOT / "sft-lora")
    cli(gpu_ray, "tasks.sft", output=sft, pretrain=data, dataset=data, max_steps=100, **GPU_FLAGS)
    layouts = {"colocated": {"colocate_all_models": True, "vllm_gpu_memory_utilization": 0.2}}
    if torch.cuda.device_count() >= 2:
        layouts["separate"] = {"async_train": True, "vllm_gpu_memory_utilization": 0.3}
    for name, layout in layouts.items():
        out = str(ROOT / f"rl-lora-{name}")
        cli(
            gpu_ray,
            "tasks.rl",
            output=out,
            pretrain=sft,
            prompt_data=data,
            **{
                **GRPO,
                **GPU_FLAGS,
                **STYLE,
                **layout,
                "max_steps": 6,
                "lora_rank": 16,
                "lora_alpha": 32,
                "actor_learning_rate": 2e-3,
                "init_kl_coef": 0.001,
            },
        )
        logged = metrics(out)
        gaps, kl = [r["engine_logprob_max_diff"] for r in logged], [r["kl"] for r in logged]
        print(f"rl with lora, {name}: engine vs actor gap per step {gaps}; kl to the base {kl}")
        assert len(gaps) == 6 and max(gaps) < 0.25, (name, gaps)
        assert kl[-1] > 0.05, (name, kl)  # far enough that an engine left on the base would show in the gaps


def learned(ray: str, data: str, sft: str, name: str, **values) -> dict:
    rl, ev = str(ROOT / f"rl-{name}"), str(ROOT / f"eval-{name}")
    cli(ray, "tasks.rl", output=rl, pretrain=sft, prompt_data=data, **{**GRPO, **GPU_FLAGS, **values})
    cli(ray, "tasks.eval", output=ev, baseline=sft, policy=rl, dataset=data, metric_func="tasks/data/demo_metrics.py")
    path, _ = manifests.fetch(ev, ROOT / "fetched" / f"eval-{name}")
    return json.loads((path / "report.json").read_text())["metrics"]["policy"]


COLOCATED = {"colocate_all_models": True, "vllm_gpu_memory_utilization": 0.3}
ARMS = {  # each trained with the terse-style reward, and held against the same zero-reward control
    "on-policy": COLOCATED,
    # through the adapter synced to vLLM after each update, at a LoRA learning rate
    "lora": {**COLOCATED, "lora_rank": 16, "lora_alpha": 32, "actor_learning_rate": 3e-4},
    "off-policy": {"async_train": True},  # the actor on one GPU, the engine on the other, a step ahead
}


@pytest.fixture(scope="module")
def learning_start(gpu_ray, data):
    """The demo's SFT model for the learning check, and its zero-reward control's preferred-style rate."""
    sft = str(ROOT / "sft-learn")
    cli(gpu_ray, "tasks.sft", output=sft, pretrain=data, dataset=data, max_steps=500, **GPU_FLAGS)
    return sft, learned(gpu_ray, data, sft, "control", **CONTROL, **COLOCATED)["sampled_preferred_style_rate"]


@pytest.mark.parametrize("arm", list(ARMS))
def test_demo_learns_on_the_gpu_path(arm, gpu_ray, data, learning_start):
    if arm == "off-policy" and torch.cuda.device_count() < 2:
        pytest.skip("needs a second GPU for the engine")
    sft, control = learning_start
    rate = learned(gpu_ray, data, sft, arm, **STYLE, **ARMS[arm])["sampled_preferred_style_rate"]
    print(f"preferred-style rate after 30 GRPO steps on the gpu, {arm}: {rate:.3f} against the control's {control:.3f}")
    record = ROOT / "learning.json"
    rates = json.loads(record.read_text()) if record.exists() else {}
    record.write_text(json.dumps({**rates, "control": control, arm: rate}))
    assert rate >= control + 0.15, arm
