"""Multi-turn episodes: the environment a user writes (``rollout.env``), tool calls parsed per model family, and
the runner that drives a rollout engine turn by turn with exact tokens across turns; or a black-box agent
(``rollout.agent``) served an OpenAI-compatible endpoint whose calls are assembled into episodes.

Each turn's prompt is the previous prompt, the sampled tokens verbatim and the environment's messages as the chat
template's delta; an :class:`Episode` carries its per-token mask (1 on the policy's tokens, 0 on the
environment's), behaviour log-probs and versions.
"""

from typing import TYPE_CHECKING

from relax_services._lazy import lazy_exports

if TYPE_CHECKING:
    from relax_services.agents.agent import AgentFn, AgentSpec, AgentSpecError, load_agent
    from relax_services.agents.agent_runner import AgentRunner
    from relax_services.agents.chat import ChatTemplateError, ChatTokens, PrefixBreakError
    from relax_services.agents.environment import (
        LIFECYCLE_METHODS,
        EnvironmentSpec,
        EnvironmentSpecError,
        Message,
        ToolSpec,
        load_environment,
    )
    from relax_services.agents.episode import EPISODE_FINISHES, Episode, EpisodeCounters, EpisodeFinish
    from relax_services.agents.media import EpisodeMedia, MediaTurn, UnsupportedMediaError
    from relax_services.agents.parsers import (
        TOOL_PARSERS,
        TOOL_TEXT,
        ToolCall,
        ToolParser,
        parse_qwen_tool_calls,
        qwen_text_outside_calls,
        tool_parser,
        tool_text,
    )
    from relax_services.agents.runner import AgentConfig, EpisodeRunner

_EXPORTS: dict[str, str] = {
    "LIFECYCLE_METHODS": "relax_services.agents.environment",
    "EnvironmentSpec": "relax_services.agents.environment",
    "EnvironmentSpecError": "relax_services.agents.environment",
    "Message": "relax_services.agents.environment",
    "ToolSpec": "relax_services.agents.environment",
    "load_environment": "relax_services.agents.environment",
    "TOOL_PARSERS": "relax_services.agents.parsers",
    "ToolCall": "relax_services.agents.parsers",
    "ToolParser": "relax_services.agents.parsers",
    "parse_qwen_tool_calls": "relax_services.agents.parsers",
    "tool_parser": "relax_services.agents.parsers",
    "TOOL_TEXT": "relax_services.agents.parsers",
    "qwen_text_outside_calls": "relax_services.agents.parsers",
    "tool_text": "relax_services.agents.parsers",
    "ChatTemplateError": "relax_services.agents.chat",
    "ChatTokens": "relax_services.agents.chat",
    "PrefixBreakError": "relax_services.agents.chat",
    "EPISODE_FINISHES": "relax_services.agents.episode",
    "Episode": "relax_services.agents.episode",
    "EpisodeCounters": "relax_services.agents.episode",
    "EpisodeFinish": "relax_services.agents.episode",
    "EpisodeMedia": "relax_services.agents.media",
    "MediaTurn": "relax_services.agents.media",
    "UnsupportedMediaError": "relax_services.agents.media",
    "AgentConfig": "relax_services.agents.runner",
    "EpisodeRunner": "relax_services.agents.runner",
    "AgentFn": "relax_services.agents.agent",
    "AgentSpec": "relax_services.agents.agent",
    "AgentSpecError": "relax_services.agents.agent",
    "load_agent": "relax_services.agents.agent",
    "AgentRunner": "relax_services.agents.agent_runner",
}

# the environment a user writes
__all__ = ["LIFECYCLE_METHODS", "EnvironmentSpec", "EnvironmentSpecError", "Message", "ToolSpec", "load_environment"]

# tool calls
__all__ += [
    "TOOL_PARSERS",
    "TOOL_TEXT",
    "ToolCall",
    "ToolParser",
    "parse_qwen_tool_calls",
    "qwen_text_outside_calls",
    "tool_parser",
    "tool_text",
]

# exact tokens across turns
__all__ += ["ChatTemplateError", "ChatTokens", "PrefixBreakError"]

# episodes and the runner
__all__ += ["EPISODE_FINISHES", "AgentConfig", "Episode", "EpisodeCounters", "EpisodeFinish", "EpisodeRunner"]

# image, audio and video from the environment
__all__ += ["EpisodeMedia", "MediaTurn", "UnsupportedMediaError"]

# the black-box agent
__all__ += ["AgentFn", "AgentRunner", "AgentSpec", "AgentSpecError", "load_agent"]

__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
