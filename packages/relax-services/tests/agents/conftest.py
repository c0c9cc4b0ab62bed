"""Fixtures of the multi-turn tests: a tokenizer with Qwen2.5's tool-calling chat template, a scripted rollout
engine (assistant turns chosen by the test, so tool calls happen deterministically), and environment files."""

from __future__ import annotations

import string
import textwrap
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

import pytest
import torch

from relax_services.agents import EnvironmentSpec, load_environment
from relax_services.engines import Completion, SamplingParams, WeightPoll
from relax_services.models import OmniPrompt
from relax_services.models.tiny_tokenizer import ROLE_WORDS, SPECIAL_TOKENS, TINY_CHARACTERS, build_tiny_tokenizer

# Qwen2.5-Instruct's chat template, its text and tool-calling branches as published (tools listed in the system
# turn, consecutive tool results grouped in one user turn of <tool_response> blocks); the branch that renders an
# assistant message's structured ``tool_calls`` is left out (episodes keep the sampled text verbatim instead).
QWEN25_TOOL_TEMPLATE = (
    "{%- if tools %}{{- '<|im_start|>system\\n' }}"
    "{%- if messages[0]['role'] == 'system' %}{{- messages[0]['content'] }}"
    "{%- else %}{{- 'You are Qwen, created by Alibaba Cloud. You are a helpful assistant.' }}{%- endif %}"
    '{{- "\\n\\n# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\n'
    'You are provided with function signatures within <tools></tools> XML tags:\\n<tools>" }}'
    '{%- for tool in tools %}{{- "\\n" }}{{- tool | tojson }}{%- endfor %}'
    '{{- "\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments within '
    '<tool_call></tool_call> XML tags:\\n<tool_call>\\n{\\"name\\": <function-name>, \\"arguments\\": '
    '<args-json-object>}\\n</tool_call><|im_end|>\\n" }}'
    "{%- else %}{%- if messages[0]['role'] == 'system' %}"
    "{{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}"
    "{%- else %}{{- '<|im_start|>system\\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant."
    "<|im_end|>\\n' }}{%- endif %}{%- endif %}"
    "{%- for message in messages %}"
    "{%- if (message.role == 'user') or (message.role == 'system' and not loop.first) or "
    "(message.role == 'assistant') %}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}"
    "{%- elif message.role == 'tool' %}"
    "{%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != 'tool') %}{{- '<|im_start|>user' }}{%- endif %}"
    "{{- '\\n<tool_response>\\n' }}{{- message.content }}{{- '\\n</tool_response>' }}"
    "{%- if loop.last or (messages[loop.index0 + 1].role != 'tool') %}{{- '<|im_end|>\\n' }}{%- endif %}"
    "{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

_KNOWN = {*SPECIAL_TOKENS, *ROLE_WORDS, *TINY_CHARACTERS}
PRINTABLE_EXTRA = tuple(c for c in string.printable if c not in _KNOWN)
"""Printable ASCII the default tokenizer lacks: JSON, tags and error messages need them."""


@pytest.fixture(scope="session")
def qwen_tokenizer() -> object:
    """The default tokenizer with every printable character and Qwen2.5's tool-calling template."""
    tokenizer = build_tiny_tokenizer(PRINTABLE_EXTRA)
    tokenizer.chat_template = QWEN25_TOOL_TEMPLATE
    return tokenizer


Script = Callable[[str], str]
"""Decoded prompt → the assistant's next turn (its text, without the eos)."""


class ScriptedEngine:
    """A rollout engine whose assistant turns a test script writes: each turn's tokens are the script's text
    tokenised, then the eos (cut at ``max_new_tokens``, finish ``length``); log-prob of the i-th token -(i+1)/64.

    Attributes:
        calls: ``(number of prompts, params)`` of every ``generate`` call.
        prompts: Every prompt's ids, per call.
        media: Every prompt's media tensors, per call.
    """

    def __init__(self, tokenizer: object, script: Script, version: int = 3) -> None:
        self.tokenizer = tokenizer
        self.script = script
        self._version = version
        self.calls: list[tuple[int, SamplingParams]] = []
        self.prompts: list[list[list[int]]] = []
        self.media: list[list[dict[str, torch.Tensor]]] = []

    @property
    def version(self) -> int:
        return self._version

    def load_weights(self, state_dict: Mapping[str, torch.Tensor], version: int) -> None:
        self._version = version

    def seed(self, seed: int) -> None:
        pass

    def generate(
        self, prompts: Sequence[OmniPrompt], params: SamplingParams, poll_weights: WeightPoll | None = None
    ) -> list[list[Completion]]:
        self.calls.append((len(prompts), params))
        self.prompts.append([p.input_ids.tolist() for p in prompts])
        self.media.append([p.media() for p in prompts])
        out = []
        for prompt in prompts:
            text = self.script(self.tokenizer.decode(prompt.input_ids.tolist()))  # type: ignore[attr-defined]
            ids = [*self.tokenizer.encode(text, add_special_tokens=False), params.eos_id]  # type: ignore[attr-defined]
            cut = len(ids) > params.max_new_tokens
            ids = ids[: params.max_new_tokens]
            logprobs = [-(i + 1) / 64 for i in range(len(ids))]
            completion = Completion(
                token_ids=ids,
                logprobs=logprobs,
                sampling_logprobs=logprobs,
                versions=[self._version] * len(ids),
                finish_reason="length" if cut else "stop",
            )
            out.append([completion] * params.n)
        return out


@pytest.fixture
def scripted_engine() -> type[ScriptedEngine]:
    """:class:`ScriptedEngine`."""
    return ScriptedEngine


@pytest.fixture
def write_env(tmp_path: Path) -> Callable[[str, str], EnvironmentSpec]:
    """Writes an environment module's source to a file and loads ``file.py:Class`` from it."""
    count = iter(range(1_000_000))

    def write(source: str, cls: str = "Env") -> EnvironmentSpec:
        path = tmp_path / f"env_{next(count)}.py"
        path.write_text(textwrap.dedent(source))
        return load_environment(f"{path}:{cls}")

    return write
