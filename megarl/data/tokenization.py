"""Prompt encoding (chat template + tokenizer) and response decoding.

Data path: `PromptRecord.prompt` (a string or a chat message list) -> template -> text -> prompt token ids (what
the rollout engine generates from); response token ids from the engine -> text (what reward functions score).
Overlong prompts are not handled here: the rollout engine drops / truncates them (`rollout.overlong_prompt`).

`chat_template` (the `data.chat_template` config key):
  None or "hf"  the tokenizer's own chat template (``apply_chat_template(..., add_generation_prompt=True)``); a
                string prompt becomes one user message.
  "none"        the raw prompt text, tokenised with the tokenizer's special-token convention (e.g. a BOS).
  "...{prompt}..."  a plain template: ``{prompt}`` is replaced by the prompt text (no other braces are
                interpreted); string prompts only.
  "{% ... %}" / "{{ ... }}"  a Jinja chat template used instead of the tokenizer's (HF semantics).
"""

from __future__ import annotations

from typing import Any, Optional, Sequence

from megarl.data.dataset import Prompt

_MODES = "'none', 'hf' (or null), a template string containing {prompt}, or a Jinja chat template"


def _is_jinja(template: str) -> bool:
    return "{%" in template or "{{" in template


class PromptEncoder:
    """Turns prompts into token ids and response token ids back into text.

    tokenizer: a HF tokenizer directory / hub name (loaded with `AutoTokenizer`), or a tokenizer object.
    chat_template: see the module docstring.
    """

    def __init__(self, tokenizer: Any, chat_template: Optional[str] = None) -> None:
        if isinstance(tokenizer, str):
            from transformers import AutoTokenizer

            try:
                tokenizer = AutoTokenizer.from_pretrained(tokenizer)
            except (OSError, ValueError) as e:
                raise ValueError(f"cannot load the tokenizer from {tokenizer!r}: {e}") from None
        self.tokenizer = tokenizer
        if chat_template is None or chat_template == "hf":
            self.mode = "hf"
            if not getattr(tokenizer, "chat_template", None):
                raise ValueError(
                    f"chat_template={chat_template!r} uses the tokenizer's chat template, but tokenizer "
                    f"{getattr(tokenizer, 'name_or_path', '')!r} has none; set data.chat_template to {_MODES}"
                )
        elif chat_template == "none":
            self.mode = "none"
        elif _is_jinja(chat_template):
            self.mode = "jinja"
        elif "{prompt}" in chat_template:
            self.mode = "format"
        else:
            raise ValueError(f"chat_template {chat_template!r} is not one of {_MODES}")
        self.chat_template = chat_template

    # ------------------------------------------------------------------------------------------------ encode
    def render(self, prompt: Prompt) -> str:
        """The prompt text after the template (what is tokenised)."""
        if self.mode in ("none", "format"):
            if not isinstance(prompt, str):
                raise ValueError(
                    f"chat_template={self.chat_template!r} formats string prompts, but this prompt is a chat message "
                    "list; use chat_template 'hf' (the tokenizer's template) or a Jinja chat template"
                )
            return prompt if self.mode == "none" else self.chat_template.replace("{prompt}", prompt)
        messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else list(prompt)
        kwargs = {"chat_template": self.chat_template} if self.mode == "jinja" else {}
        return self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, **kwargs)

    def encode(self, prompt: Prompt) -> list[int]:
        """Prompt token ids. Chat templates write their own special tokens (no BOS is added to the rendered
        text); 'none' and {prompt} templates add the tokenizer's usual special tokens."""
        text = self.render(prompt)
        ids = list(self.tokenizer.encode(text, add_special_tokens=self.mode in ("none", "format")))
        if not ids:
            raise ValueError(f"prompt {text!r:.80} encodes to no tokens; a prompt needs at least one token")
        return ids

    def encode_batch(self, prompts: Sequence[Prompt]) -> list[list[int]]:
        return [self.encode(p) for p in prompts]

    # ------------------------------------------------------------------------------------------------ decode
    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """Response text (special tokens such as EOS removed by default), stripped of surrounding whitespace."""
        return self.tokenizer.decode(list(ids), skip_special_tokens=skip_special_tokens).strip()

    def decode_batch(self, batch: Sequence[Sequence[int]], skip_special_tokens: bool = True) -> list[str]:
        return [self.decode(ids, skip_special_tokens) for ids in batch]

    @property
    def eos_token_id(self) -> Optional[int]:
        return self.tokenizer.eos_token_id

    @property
    def pad_token_id(self) -> Optional[int]:
        return self.tokenizer.pad_token_id
