"""Reward-model stage (pairwise Bradley-Terry).

python -m tasks.reward_model --pretrain <sft URI> --dataset <data URI> --output <URI> [--max_steps 300 …]
"""

from tasks.common.stage import main
from tasks.reward_model.config import RewardModelConfig
from tasks.reward_model.trainer import train

if __name__ == "__main__":
    main("reward_model", RewardModelConfig, train)
