"""RL stage (PPO with a critic and GAE, or REINFORCE++ / RLOO / GRPO / Dr. GRPO without one).

python -m tasks.rl --pretrain <sft URI> --reward_pretrain <rm URI> --prompt_data <data URI> --output <URI>
"""

from tasks.common.stage import main
from tasks.rl.config import RLConfig
from tasks.rl.trainer import train

if __name__ == "__main__":
    main("rl", RLConfig, train)
