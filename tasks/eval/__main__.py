"""Evaluation stage: the baseline (SFT) and the trained policy side by side on held-out prompts.

    python -m tasks.eval --baseline <sft URI> --policy <rl URI> --reward_pretrain <rm URI> \
        --dataset <data URI> --output <URI>

Writes report.json, report.md and manifest.json; prints the table.
"""

from tasks.common.stage import main
from tasks.eval.config import EvalConfig
from tasks.eval.evaluate import evaluate

if __name__ == "__main__":
    main("eval", EvalConfig, evaluate)
