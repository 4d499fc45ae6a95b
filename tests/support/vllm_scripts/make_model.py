"""Make the tiny model the real-engine suite serves: random weights (seeded), a byte-level BPE tokenizer trained
here on a corpus this script writes, and a chat template that renders tools and tool calls the way vLLM's
``hermes`` tool parser reads them (``<tool_call>{...}</tool_call>``).

Runs in the vLLM environment (it has torch, transformers and tokenizers): ``python make_model.py <dir>``. Nothing
is downloaded. CPU attention in vLLM needs a head size of at least 32, so the model has two heads of 32.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<tool_call>", "</tool_call>"]

CHAT_TEMPLATE = (
    "{% if tools %}"
    "<|im_start|>system\n"
    "{% if messages[0].role == 'system' %}{{ messages[0].content }}\n\n{% endif %}"
    "You may call functions. Their signatures:\n<tools>\n"
    "{% for tool in tools %}{{ tool | tojson }}\n{% endfor %}"
    '</tools>\nAnswer a call as <tool_call>{"name": <name>, "arguments": <args>}</tool_call><|im_end|>\n'
    "{% elif messages[0].role == 'system' %}"
    "<|im_start|>system\n{{ messages[0].content }}<|im_end|>\n"
    "{% endif %}"
    "{% for message in messages %}"
    "{% if message.role == 'system' %}"
    "{% elif message.role == 'assistant' %}"
    "<|im_start|>assistant\n{% if message.content %}{{ message.content }}{% endif %}"
    "{% for call in message.tool_calls or [] %}"
    "{% set function = call.function if call.function is defined else call %}"
    '<tool_call>{"name": "{{ function.name }}", "arguments": '
    "{% if function.arguments is string %}{{ function.arguments }}{% else %}{{ function.arguments | tojson }}"
    "{% endif %}}</tool_call>"
    "{% endfor %}<|im_end|>\n"
    "{% elif message.role == 'tool' %}"
    "<|im_start|>user\n<tool_response>{{ message.content }}</tool_response><|im_end|>\n"
    "{% else %}"
    "<|im_start|>{{ message.role }}\n{{ message.content }}<|im_end|>\n"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

_TEXT = (
    "the a an of to in is it that was for on are with as be at by this have from or one had not but what all "
    "were when we there can your which their said if do will each about how up out them then she many some so "
    "these would other into has more her two like him see time could no make than first been its who now people "
    "my made over did down only way find use may water long little very after words called just where most know "
    "answer question weather city paris london tokyo berlin rome number sum add multiply calculator result "
    "hello world please thanks agent reward rollout token model train policy value step tool call function "
    "name arguments true false null zero three four five six seven eight nine ten hundred thousand"
)
WORDS = _TEXT.split()


def corpus() -> list[str]:
    """Text the tokenizer learns from: words, numbers, JSON of tool calls and the template's own markup."""
    lines = []
    for i, word in enumerate(WORDS):
        tail = " ".join(WORDS[(i * 7 + k) % len(WORDS)] for k in range(12))
        lines.append(f"{word.capitalize()} {tail}. {i} + {i * 3} = {i * 4}!")
        call = {"name": f"get_{word}", "arguments": {"city": WORDS[(i * 5) % len(WORDS)], "count": i}}
        lines.append(json.dumps(call))
    lines.append('{"type": "function", "function": {"name": "x", "description": "y", "parameters": {}}}')
    lines.append("<tools>\n</tools>\n<tool_response></tool_response> system user assistant")
    return lines * 4


def main(target: Path) -> None:
    import torch  # type: ignore[import-not-found, unused-ignore]
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import (  # type: ignore[import-not-found, unused-ignore]
        PreTrainedTokenizerFast,
        Qwen2Config,
        Qwen2ForCausalLM,
    )

    target.mkdir(parents=True, exist_ok=True)
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=1024, special_tokens=SPECIAL, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    bpe.train_from_iterator(corpus(), trainer)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=bpe,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        additional_special_tokens=["<|im_start|>"],
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.save_pretrained(target)

    torch.manual_seed(20261128)
    config = Qwen2Config(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=32,
        max_position_embeddings=4096,
        tie_word_embeddings=False,
        eos_token_id=tokenizer.convert_tokens_to_ids("<|im_end|>"),
        bos_token_id=tokenizer.convert_tokens_to_ids("<|endoftext|>"),
        pad_token_id=tokenizer.convert_tokens_to_ids("<|endoftext|>"),
        torch_dtype="float32",
    )
    model = Qwen2ForCausalLM(config)
    with torch.no_grad():
        # An output head of its own, not the input embedding's transpose (which makes every token predict itself),
        # with logits spread enough that sampled answers vary and greedy ones do not loop at once.
        model.lm_head.weight.normal_(0.0, 0.3)
    model.save_pretrained(target, safe_serialization=True)
    (target / "generation_config.json").write_text(json.dumps({"eos_token_id": config.eos_token_id}))
    print(json.dumps({"model": str(target), "vocab": len(tokenizer)}))


if __name__ == "__main__":
    main(Path(sys.argv[1]))
