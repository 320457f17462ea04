"""Tokenizer / chat-template oracle for tests/generate_tokenizer.rs.

usage: python3 tokenizer_oracle.py MODEL_DIR < request.json

request: {"texts": [str, ...], "chats": [{"messages": [...], "add_generation_prompt": bool}, ...]}
prints:  {"texts": [{"ids": [...], "ids_special": [...], "decoded": str}, ...],
          "chats": [{"text": str, "ids": [...]}, ...]}

Chat text comes from transformers' apply_chat_template(tokenize=False); ids from the
`tokenizers` library encoding that text without added specials (what
apply_chat_template(tokenize=True) does).
"""

import json
import os
import sys

os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

from tokenizers import Tokenizer  # noqa: E402
from transformers import AutoTokenizer  # noqa: E402


def main() -> None:
    model_dir = sys.argv[1]
    request = json.load(sys.stdin)
    fast = Tokenizer.from_file(os.path.join(model_dir, "tokenizer.json"))
    hf = AutoTokenizer.from_pretrained(model_dir)
    texts = []
    for text in request["texts"]:
        ids = fast.encode(text, add_special_tokens=False).ids
        texts.append(
            {
                "ids": ids,
                "ids_special": fast.encode(text, add_special_tokens=True).ids,
                "decoded": fast.decode(ids, skip_special_tokens=False),
            }
        )
    chats = []
    for chat in request["chats"]:
        text = hf.apply_chat_template(
            chat["messages"],
            tokenize=False,
            add_generation_prompt=chat["add_generation_prompt"],
        )
        chats.append({"text": text, "ids": fast.encode(text, add_special_tokens=False).ids})
    json.dump({"texts": texts, "chats": chats}, sys.stdout, ensure_ascii=False)


if __name__ == "__main__":
    main()
