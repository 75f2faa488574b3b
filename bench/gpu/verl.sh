#!/usr/bin/env bash
# verl 0.9.1 beside our stack, for bench/verl_bench.py (run.sh's `verl` phase). Two verbs:
#
#   here:        bash bench/gpu/verl.sh pack      # cp312 wheels into .scratch/gpu/verl/ (about 20 MB)
#   device call: bash bench/gpu/verl.sh install   # carry [".scratch/gpu/verl"]; after install.sh and flash_attn.sh
#                                                 # (its FSDP actor asks for flash_attention_2); into /tmp/site-verl,
#                                                 # then an import check
#
# verl 0.9.1 wants transformers >=5.5.3,<5.11 (the machine has 5.17) and its [vllm] extra pins vllm 0.24; it goes in
# with --no-deps into a folder of its own, first on PYTHONPATH for that phase alone, beside our ray 2.60, vLLM 0.26.0
# and torch 2.11. The folder also holds transformers 5.10.4, which shadows ours there, and tokenizers 0.22.2: 5.10.4
# checks tokenizers <=0.23.0 at import and 0.23.0 itself was never released as a wheel (5.17 needs >=0.23.1).
# huggingface_hub stays the machine's (both transformers want >=1.5,<2).
# What the trainer's path (main_ppo, the v1 trainer, FSDP engine workers, agent and reward loops, the vLLM server)
# imports at module level and the machine lacks: hydra-core, omegaconf and antlr4 4.9.3 (omegaconf pins 4.9.*; an
# sdist only, so `pack` builds its pure-Python wheel here), codetiming, tensordict (+ pyvers), torchdata, TransferQueue
# (the default v1 trainer), orjson (verl.utils.tracking); cloudpickle, prometheus_client and aiohttp (+ deps) go in
# only where the machine has none. verl's other requirements (wandb, tensorboard, pylatexenc, pybind11) are imported
# only by loggers, reward scorers or builds this bench does not use. One edit to the installed copy, see `patch` below.
set -euo pipefail
cd "$(dirname "$0")/../.."
here=.scratch/gpu/verl
site=/tmp/site-verl
always="verl==0.9.1 transformers==5.10.4 tokenizers==0.22.2 hydra-core==1.3.8 omegaconf==2.3.1 codetiming==1.4.0 tensordict==0.10.0 pyvers==0.1.0 torchdata==0.11.0 transferqueue==0.1.11 orjson==3.13.0 model-hosting-container-standards==0.1.16"
sdist="antlr4-python3-runtime==4.9.3"
aiohttp_group="aiohttp==3.14.5 aiohappyeyeballs==2.7.1 aiosignal==1.4.0 frozenlist==1.8.0 multidict==7.2.1 propcache==0.5.4 yarl==1.25.1"
if_missing="cloudpickle==3.1.3 prometheus-client==0.26.0"
# a spec's wheel in $here: dashes become underscores in wheel names
wheel_of() { local name=${1%%==*} version=${1##*==}; echo "$here/${name//-/_}-$version-"*.whl; }
case "${1:?usage: verl.sh pack|install}" in
  pack)
    mkdir -p $here
    pip="${PIP:-.venv/bin/pip}"
    # shellcheck disable=SC2086
    "$pip" download --quiet --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
      --platform manylinux2014_x86_64 --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
      --platform manylinux_2_31_x86_64 --platform manylinux_2_34_x86_64 --platform any \
      -d $here $always $aiohttp_group $if_missing
    # pure Python: a wheel built here installs anywhere, and the machine needs no build step
    "$pip" wheel --quiet --no-deps --no-binary=:all: -w $here "$sdist"
    ls -la $here; du -sh $here ;;
  install)
    if [ -f $site/.installed ]; then echo "installed already"; exit 0; fi
    source bench/gpu/env.sh  # PYTHONPATH=/tmp/site:<repo>: our stack, which decides what is missing
    wheels=()
    for spec in $always $sdist; do wheels+=($(wheel_of "$spec")); done
    if python -c "import aiohttp" 2>/dev/null; then echo "aiohttp: the machine's"
    else for spec in $aiohttp_group; do wheels+=($(wheel_of "$spec")); done; fi
    for spec in $if_missing; do
      dist=${spec%%==*}; mod=${dist//-/_}
      if python -c "import $mod" 2>/dev/null; then echo "$dist: the machine's"; else wheels+=($(wheel_of "$spec")); fi
    done
    rm -rf $site && mkdir -p $site
    pip install --quiet --no-index --no-deps --target $site "${wheels[@]}"
    # patches (each fails loudly if verl's text moved):
    # 1. verl picks its prompt builder by config.json's model_type, and for qwen2 that is the Qwen (ChatML) builder,
    # which looks up <|im_end|> when it starts. The bench tokenizer has one character per token and no such token, so
    # every agent-loop worker would stop there. The default builder renders the same single-turn prompt (Qwen's only
    # adds a newline between turns), so qwen2 maps to it here.
    # 2. When trl is importable, verl's monkey patch reaches for trl's value-head model, which trl 1.16 (ours) no
    # longer has: every actor stopped at `ImportError: cannot import name 'AutoModelForCausalLMWithValueHead'` on
    # 2026-12-04. The bench trains no value head, so the patch is skipped when the class is missing.
    python - $site/verl <<'EOF'
import sys
root = sys.argv[1]
edits = [
    ("utils/tokenizer/continuous_token_wiring.py",
     '    "qwen2": ContinuousTokenModelFamily.QWEN,\n',
     '    "qwen2": ContinuousTokenModelFamily.DEFAULT,  # bench/gpu/verl.sh: the bench tokenizer has no <|im_end|>\n'),
    ("models/transformers/monkey_patch.py",
     "            from trl import AutoModelForCausalLMWithValueHead  # type: ignore\n",
     "            AutoModelForCausalLMWithValueHead = getattr(__import__('trl'), 'AutoModelForCausalLMWithValueHead', None)  # bench/gpu/verl.sh\n"),
    ("models/transformers/monkey_patch.py",
     "        AutoModelForCausalLMWithValueHead.state_dict = state_dict\n",
     "        if AutoModelForCausalLMWithValueHead is not None:  # bench/gpu/verl.sh: trl 1.16 has none\n"
     "            AutoModelForCausalLMWithValueHead.state_dict = state_dict\n"),
]
for rel, old, new in edits:
    path = f"{root}/{rel}"
    text = open(path).read()
    assert text.count(old) == 1, f"{rel} changed: patch it by hand"
    open(path, "w").write(text.replace(old, new))
    print("patched", path)
EOF
    PYTHONPATH="$site:$PYTHONPATH" python -c "
import importlib.metadata as md, importlib.util
import hydra, omegaconf, antlr4, codetiming, tensordict, torchdata.stateful_dataloader, transfer_queue, orjson, cloudpickle, aiohttp
import transformers, tokenizers
assert transformers.__version__ == '5.10.4' and tokenizers.__version__ == '0.22.2', (transformers.__version__, tokenizers.__version__)
import verl.trainer.main_ppo, verl.trainer.main_ppo_v0, verl.trainer.ppo.v1, verl.workers.engine_workers, verl.workers.engine.fsdp
import verl.experimental.agent_loop, verl.experimental.reward_loop, verl.checkpoint_engine
import verl.workers.rollout.vllm_rollout.vllm_async_server, verl.workers.rollout.vllm_rollout.vllm_rollout
from verl.utils.tokenizer.continuous_token_wiring import infer_continuous_token_model_family
assert infer_continuous_token_model_family(hf_model_type='qwen2').value == 'default'
for p in ('verl', 'ray', 'vllm', 'transformers', 'tokenizers', 'huggingface_hub', 'torch', 'tensordict', 'transferqueue', 'peft'):
    print(p, md.version(p.replace('_', '-')), end='; ')
# the default run's actor asks for flash_attention_2 (verl_bench.py --sdpa does without)
print('flash_attn', md.version('flash-attn') if importlib.util.find_spec('flash_attn') else 'MISSING: bash bench/gpu/flash_attn.sh install', end='; ')
print('imports ok')"
    touch $site/.installed ;;
  *) echo "unknown verb $1; use pack or install"; exit 2 ;;
esac
