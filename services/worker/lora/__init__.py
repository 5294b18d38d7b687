"""LoRA adapters in the worker: PEFT folders loaded to host memory (adapter.py), batched
LoRA linears wrapped around the model's own (layers.py), and the slots that hold up to
max_loras adapters for one batch (manager.py)."""
