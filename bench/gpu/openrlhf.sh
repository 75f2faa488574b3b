#!/usr/bin/env bash
# OpenRLHF 0.11.2 beside our stack, for bench/openrlhf_bench.py (run.sh's `openrlhf` phase). Two verbs:
#
#   here:        bash bench/gpu/openrlhf.sh pack      # cp312 wheels into .scratch/gpu/openrlhf/ (about 11 MB)
#   device call: bash bench/gpu/openrlhf.sh install   # carry [".scratch/gpu/openrlhf"]; after install.sh and
#                                                     # flash_attn.sh; into /tmp/site-openrlhf, then an import check
#
# OpenRLHF pins ray 2.55, deepspeed 0.19.6, transformers 5.15 and vllm 0.29; it goes in with --no-deps beside ours
# (ray 2.60, deepspeed 0.19.8, transformers 5.17, vllm 0.26.0) into a folder of its own, first on PYTHONPATH for
# that phase alone. What its train_ppo_ray path imports and the machine lacks: torchdata (StatefulDataLoader),
# pylatexenc (openrlhf.utils imports math_utils), and, where the machine has none, aiohttp and its deps
# (openrlhf.utils.agent; Ray's own copy is private to its runtime-env agent), attrs and Pillow (openrlhf.utils.vlm_utils).
# sympy comes with torch. One edit to the installed copy, see `patch` below.
set -euo pipefail
cd "$(dirname "$0")/../.."
here=.scratch/gpu/openrlhf
site=/tmp/site-openrlhf
always="openrlhf==0.11.2 torchdata==0.11.0 pylatexenc==2.11"
aiohttp_group="aiohttp==3.14.5 aiohappyeyeballs==2.7.1 aiosignal==1.4.0 frozenlist==1.8.0 multidict==7.2.1 propcache==0.5.4 yarl==1.25.1"
if_missing="attrs==26.1.0 pillow==13.0.0"
case "${1:?usage: openrlhf.sh pack|install}" in
  pack)
    mkdir -p $here
    pip="${PIP:-.venv/bin/pip}"
    # shellcheck disable=SC2086
    "$pip" download --quiet --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
      --platform manylinux2014_x86_64 --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
      --platform manylinux_2_31_x86_64 --platform manylinux_2_34_x86_64 --platform any \
      -d $here $always $aiohttp_group $if_missing
    ls -la $here; du -sh $here ;;
  install)
    if [ -f $site/.installed ]; then echo "installed already"; exit 0; fi
    source bench/gpu/env.sh  # PYTHONPATH=/tmp/site:<repo>: our stack, which decides what is missing
    wheels=()
    for spec in $always; do wheels+=($here/"${spec%%==*}"-*.whl); done
    if python -c "import aiohttp" 2>/dev/null; then echo "aiohttp: the machine's"
    else for spec in $aiohttp_group; do wheels+=($here/"${spec%%==*}"-*.whl); done; fi
    for spec in $if_missing; do
      dist=${spec%%==*}; mod=$dist; [ "$dist" = attrs ] && mod=attr; [ "$dist" = pillow ] && mod=PIL
      if python -c "import $mod" 2>/dev/null; then echo "$dist: the machine's"; else wheels+=($here/"$dist"-*.whl); fi
    done
    rm -rf $site && mkdir -p $site
    pip install --quiet --no-index --no-deps --target $site "${wheels[@]}"
    # patch: OpenRLHF has no ignore_eos; the bench's completions are exactly 256 tokens (ours and TRL pass
    # ignore_eos=True to vLLM). The one SamplingParams of its training rollouts gets it, nothing else changes;
    # BENCH_IGNORE_EOS=0 (the realistic work, bench/realistic_peers.py) keeps EOS live.
    python - $site/openrlhf/trainer/ppo_utils/samples_generator.py <<'EOF'
import sys
path = sys.argv[1]
text = open(path).read()
old = '            min_tokens=generate_kwargs.get("min_new_tokens", 1),\n'
assert text.count(old) == 1, "samples_generator.py changed: patch it by hand"
new = '            ignore_eos=__import__("os").environ.get("BENCH_IGNORE_EOS", "1") == "1",  # bench/gpu/openrlhf.sh\n'
open(path, "w").write(text.replace(old, old + new))
print("patched", path)
EOF
    PYTHONPATH="$site:$PYTHONPATH" python -c "
import importlib.metadata as md, inspect
import torchdata.stateful_dataloader, pylatexenc, aiohttp, PIL, sympy, flash_attn.bert_padding, flash_attn.utils.distributed
import openrlhf.cli.train_ppo_ray, openrlhf.trainer.ppo_trainer, openrlhf.trainer.ray.vllm_worker_wrap, openrlhf.utils.agent
from openrlhf.trainer.ppo_utils import samples_generator
from vllm.utils import random_uuid
assert 'BENCH_IGNORE_EOS' in inspect.getsource(samples_generator)
for p in ('openrlhf', 'ray', 'deepspeed', 'vllm', 'transformers', 'torch', 'flash_attn', 'torchdata', 'aiohttp'):
    print(p, md.version(p.replace('_', '-')), end='; ')
print('imports ok')"
    touch $site/.installed ;;
  *) echo "unknown verb $1; use pack or install"; exit 2 ;;
esac
