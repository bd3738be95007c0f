"""Prompt tokenization for OpenVINO models: plain prompts and chat messages.

`ContinuousBatchingPipeline.add_request` with a plain string does not apply the chat
template, so Mesh always hands the engine token ids: `encode_chat` renders the model's
template (`apply_chat_template(add_generation_prompt=True)`) and tokenizes it without
adding special tokens again (the template already carries them).
"""
from __future__ import annotations

from typing import Any, Mapping, Sequence

from mesh.engines.engine_api import EngineError

ROLES = ("system", "user", "assistant", "tool", "developer")


def validate_messages(messages: Sequence[Mapping[str, Any]]) -> list[dict[str, str]]:
    """Check OpenAI-style chat messages; return them as plain {role, content} dicts."""
    if not isinstance(messages, (list, tuple)) or not messages:
        raise EngineError("chat messages must be a non-empty list of {'role', 'content'} dicts")
    clean: list[dict[str, str]] = []
    for i, msg in enumerate(messages):
        if not isinstance(msg, Mapping):
            raise EngineError(f"chat message {i} is {type(msg).__name__}, not a dict with 'role' and 'content'")
        role, content = msg.get("role"), msg.get("content")
        if role not in ROLES:
            raise EngineError(f"chat message {i} has role {role!r}; use one of {', '.join(ROLES)}")
        if not isinstance(content, str):
            raise EngineError(f"chat message {i} ({role}) needs 'content' as a string, got "
                              f"{type(content).__name__}; join multi-part content into one string")
        clean.append({"role": role, "content": content})
    return clean


class PromptEncoder:
    """Wraps an openvino_genai.Tokenizer: prompt text or chat messages -> token ids."""

    def __init__(self, tokenizer: Any) -> None:
        self._tok = tokenizer

    def encode_prompt(self, prompt: str) -> list[int]:
        if not isinstance(prompt, str) or not prompt:
            raise EngineError("the prompt must be a non-empty string")
        return self._ids(self._tok.encode(prompt))

    def encode_chat(self, messages: Sequence[Mapping[str, Any]]) -> list[int]:
        text = self.render_chat(messages)
        return self._ids(self._tok.encode(text, add_special_tokens=False))

    def render_chat(self, messages: Sequence[Mapping[str, Any]]) -> str:
        clean = validate_messages(messages)
        try:
            return self._tok.apply_chat_template(clean, add_generation_prompt=True)
        except Exception as exc:  # noqa: BLE001 - OpenVINO raises plain RuntimeError
            raise EngineError(f"the model's chat template failed on these messages: {exc}. "
                              "Check the roles alternate as the model expects, or send a plain prompt") from exc

    def decode(self, token_ids: Sequence[int]) -> str:
        return self._tok.decode(list(token_ids), skip_special_tokens=True)

    @staticmethod
    def _ids(tokenized: Any) -> list[int]:
        return [int(t) for t in tokenized.input_ids.data[0]]
