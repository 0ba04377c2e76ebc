"""Hugging Face interop for the LM: config.json fields, the weight-name mapping (dense and MoE hub layouts), loading
``model.pretrained``, the export to a transformers folder and a LoRA run's peft adapter folder. Sits above models/
(it maps their parameters) and corpus/ (the export writes the run's tokenizer)."""
