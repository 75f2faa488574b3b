"""Offline preference optimisation (DPO, IPO, cDPO, KTO) from an SFT model.

python -m tasks.preference --method dpo --pretrain s3://…/sft --dataset s3://…/prepare_data --output s3://…/preference
python -m tasks.preference --method kto --pretrain s3://…/sft --dataset s3://…/prepare_data --output s3://…/preference
"""

from tasks.common.stage import main
from tasks.preference.config import PreferenceConfig
from tasks.preference.trainer import train

if __name__ == "__main__":
    main("preference", PreferenceConfig, train)
