"""Fine-tuning data and losses: supervised fine-tuning (chat templates, rendering, packing samples into rows) and
preference tuning (DPO's pairs and loss). The task glue that trains them (task.py, dpo_task.py) sits above."""
