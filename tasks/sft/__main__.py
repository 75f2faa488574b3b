"""Supervised fine-tuning stage.

python -m tasks.sft --pretrain <model URI> --dataset <data URI> --output <URI> [--max_steps 500 …]
"""

from tasks.common.stage import main
from tasks.sft.config import SFTConfig
from tasks.sft.trainer import train

if __name__ == "__main__":
    main("sft", SFTConfig, train)
