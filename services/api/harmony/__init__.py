"""gpt-oss's harmony format (--tool-call-parser openai, --reasoning-parser openai_gptoss).

Implemented over the model's own tokenizer, with no openai-harmony wheel (which fetches its
tiktoken encoding at run time): the conversation renders to harmony text (render.py,
typescript.py) that gpt-oss's tokenizer turns into ids, its special tokens (<|start|>,
<|channel|>, <|message|>, <|end|>, <|call|>, <|return|>, <|constrain|>) each one id; the
output, detokenized with those tokens kept, splits by channel (stream.py) into reasoning,
tool calls and content (output.py)."""
