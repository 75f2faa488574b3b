"""What the stages share on the torch side: models and tokenizers (models), tokenized and packed data (data),
the losses (losses), rollouts and the HF rollout engine (rollout), the DeepSpeed strategy (strategy), Ray
worker groups (workers) and LoRA adapters (lora).

Everything directly in tasks/common needs only the standard library and yaml, so the Airflow side imports it;
everything here needs torch (tests/unit/plugins/test_operators.py keeps the line).
"""
