"""Agent environments: an agent written against the `openai` client, trained through the OpenAI endpoint.

    rollout.env: agent:path/to/file.py:run       # async def run(record, base_url) -> float | (float, dict)

`AgentRunner` has `EpisodeRunner`'s interface (`run` / `arun(records, n, client, sampling, policy_version,
uid_prefix) -> EpisodeResult`), so `BatchProducer.episode_batch` trains on it as on multi-turn episodes:

- for the rollout phase (one `arun`), the OpenAI endpoint (`megarl.serving.openai_api.create_app`) serves over the
  phase's `RolloutClient` (the router of that phase) on 127.0.0.1, a free port, as a task of the phase's event loop;
  it is stopped when the phase ends;
- each episode (`n` per record) gets its own session and base URL, "http://127.0.0.1:PORT/sessions/SESSION/v1", so
  an unmodified agent that only takes `base_url` works (`openai.AsyncOpenAI(base_url=base_url, api_key="none")`);
- the agents run concurrently, at most `max_concurrent_episodes` at once, each within `agent_timeout_s` (wall clock);
  an agent that raises, times out or returns no number ends its episode with reward 0, counted in `agent/errors` /
  `agent/timeouts` (its requests so far still train, with reward 0), and the run goes on;
- after the agent returns, its session's recorded responses become trajectories by the delta rule
  (`megarl.serving.segments.chain_segments`): one trajectory per segment, each with the episode's reward
  (`agent/segments_per_episode`); the loss mask is exactly the engine's sampled tokens, the log-probs the engine's,
  nothing re-tokenized. Group (GRPO) = the episodes of one record. An episode that sent no request yields no
  trajectory.

The agent picks its own sampling (temperature, max_tokens, ...) per request; the endpoint bounds each request to the
run's context (rollout.max_prompt_tokens + rollout.max_new_tokens) and rollout.max_new_tokens completion tokens.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import numbers
import uuid
from typing import Any, Callable, Optional, Sequence

from megarl.data.trajectory import CONTEXT_VERSION, Trajectory
from megarl.envs.episode import EpisodeResult, check_client, check_max_concurrent_episodes
from megarl.serving.openai_api import create_app, serving_in_loop
from megarl.serving.openai_protocol import OpenAIProtocol, ResponseRecord, ServeLimits
from megarl.serving.segments import chain_segments

logger = logging.getLogger("megarl.serving")

AGENT_PREFIX = "agent:"
KEY = "rollout.env"


def is_agent_spec(spec: Any) -> bool:
    """True for a `rollout.env` of the form "agent:path/to/file.py:function"."""
    return isinstance(spec, str) and spec.startswith(AGENT_PREFIX)


def load_agent(spec: str) -> Callable:
    """The agent function `spec` ("agent:path/to/file.py:function") names, loaded like `reward.file`
    (`megarl.rewards.user.load_user_function`); ConfigErrors name rollout.env, the file and the function."""
    from megarl.config.errors import ConfigError
    from megarl.envs.registry import load_env_file

    path, sep, function_name = spec[len(AGENT_PREFIX):].rpartition(":")
    if not sep or not path.endswith(".py") or not function_name:
        raise ConfigError(f"{KEY}={spec!r}: an agent is 'agent:path/to/file.py:function' (async def "
                          "function(record, base_url) -> float | (float, dict))")
    fn = load_env_file(path, function_name)
    if not inspect.iscoroutinefunction(fn):
        raise ConfigError(f"{KEY}={spec!r}: {function_name!r} must be an async function, `async def "
                          f"{function_name}(record, base_url) -> float | (float, dict)` (it talks to the endpoint "
                          "with openai.AsyncOpenAI; a blocking client would stall every other episode)")
    try:
        inspect.signature(fn).bind(None, "http://x")
    except TypeError as e:
        raise ConfigError(f"{KEY}={spec!r}: {function_name}{inspect.signature(fn)} cannot be called as "
                          f"{function_name}(record, base_url): {e}") from None
    return fn


def _reward(value: Any) -> tuple[float, dict]:
    """An agent's return value -> (reward, info); a TypeError says what an agent must return."""
    info: dict = {}
    if isinstance(value, tuple) and len(value) == 2 and isinstance(value[1], dict):
        value, info = value
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"an agent returns a number or (number, dict), got {type(value).__name__} {value!r:.80}")
    return float(value), info


class AgentRunner:
    """Runs batches of agent episodes through the OpenAI endpoint over a rollout client (module docstring).

    agent: `async def agent(record, base_url) -> float | (float, dict)`. tokenizer: the policy's (chat template).
    parser / parser_name: the tool-call parser (`rollout.tool_parser`). limits: the endpoint's `ServeLimits`.
    chat_template: a Jinja template instead of the tokenizer's. agent_timeout_s: each agent's wall-clock limit,
    seconds. max_concurrent_episodes: agents in flight at once. start_timeout_s: bound on the endpoint's start."""

    def __init__(self, agent: Callable, tokenizer: Any, parser: Callable[[str], tuple], limits: ServeLimits, *,
                 parser_name: str = "hermes", chat_template: Optional[str] = None, agent_timeout_s: float = 600.0,
                 max_concurrent_episodes: int = 256, model_name: str = "policy",
                 start_timeout_s: float = 60.0) -> None:
        if not agent_timeout_s > 0:
            raise ValueError(f"agent_timeout_s (rollout.agent_timeout_s) must be > 0 seconds, got {agent_timeout_s!r}")
        check_max_concurrent_episodes(max_concurrent_episodes)
        self.agent, self.tokenizer, self.parser, self.limits = agent, tokenizer, parser, limits
        self.parser_name, self.chat_template, self.model_name = parser_name, chat_template, model_name
        self.agent_timeout_s, self.max_concurrent_episodes = agent_timeout_s, max_concurrent_episodes
        self.start_timeout_s = start_timeout_s

    def run(self, records: Sequence[Any], n: int, client: Any, sampling: Any,
            policy_version: "int | Callable[[], int] | None" = None, uid_prefix: str = "") -> EpisodeResult:
        """`n` agent episodes per record in a new event loop (`arun` from a running one). `sampling` is not imposed
        on the agents (they choose theirs); `policy_version` fills the version of tokens the client reports none
        for. Returns trajectories (record-major, each episode's segments in order), one score per trajectory (its
        episode's reward), metrics `agent/...`."""
        check_client(client, "AgentRunner.run")
        return asyncio.run(self.arun(records, n, client, sampling, policy_version, uid_prefix))

    async def arun(self, records: Sequence[Any], n: int, client: Any, sampling: Any,
                   policy_version: "int | Callable[[], int] | None" = None, uid_prefix: str = "") -> EpisodeResult:
        """`run` as a coroutine (in the event loop the client is bound to)."""
        check_client(client, "AgentRunner.arun")
        protocol = OpenAIProtocol(client, self.tokenizer, self.parser, model_name=self.model_name,
                                  limits=self.limits, parser_name=self.parser_name, chat_template=self.chat_template)
        app = create_app(protocol)
        slots = asyncio.Semaphore(self.max_concurrent_episodes)
        counts = {"errors": 0, "timeouts": 0}
        tag = uuid.uuid4().hex[:8]

        async def episode(i: int, k: int, record: Any, root: str) -> tuple[float, dict, list[ResponseRecord]]:
            async with slots:
                session = f"{tag}-{uid_prefix.replace('/', '-')}{i}-{k}"
                protocol.open_session(session)
                reward, info = 0.0, {}
                try:
                    value = await asyncio.wait_for(self.agent(record, f"{root}/sessions/{session}/v1"),
                                                   self.agent_timeout_s)
                    reward, info = _reward(value)
                except asyncio.TimeoutError:
                    counts["timeouts"] += 1
                    logger.warning("agent episode %s%d/%d did not return within %g s (rollout.agent_timeout_s): "
                                   "cancelled, reward 0", uid_prefix, i, k, self.agent_timeout_s)
                except Exception as e:  # noqa: BLE001 -- the user's agent: counted, the run goes on
                    counts["errors"] += 1
                    logger.warning("agent episode %s%d/%d failed: %r; reward 0", uid_prefix, i, k, e)
                finally:
                    recorded = protocol.close_session(session)
                return reward, info, recorded

        async with serving_in_loop(app, start_timeout_s=self.start_timeout_s) as root:
            results = await asyncio.gather(*(episode(i, k, r, root) for i, r in enumerate(records)
                                             for k in range(n)))
        fallback = self._version(client, policy_version)
        trajectories, scores, segment_counts, requests = [], [], [], 0
        infos: dict[str, list[float]] = {}
        for index, (reward, info, recorded) in enumerate(results):
            i, k = divmod(index, n)
            segments = chain_segments(recorded)
            segment_counts.append(len(segments))
            requests += len(recorded)
            by_id = {r.request_id: r for r in recorded}
            for j, s in enumerate(segments):
                if 1 not in s.loss_mask:  # only empty completions: nothing sampled to train on
                    continue
                first_sampled = s.loss_mask.index(1)
                last = by_id[s.request_ids[-1]].choices[0]
                versions = [v if m == 0 or v >= 0 else fallback for v, m in zip(s.versions, s.loss_mask)]
                versions = [CONTEXT_VERSION if m == 0 else v for v, m in zip(versions, s.loss_mask)]
                trajectories.append(Trajectory(
                    list(s.token_ids), first_sampled, list(s.loss_mask), list(s.log_probs), versions,
                    uid=f"{uid_prefix}{i}/{k}" + (f"/s{j}" if j else ""), group_uid=f"{uid_prefix}{i}",
                    finish_reason="length" if last.finish_reason == "length" else "stop"))
                scores.append(reward)
            for key, value in info.items():
                if isinstance(value, numbers.Real) and not isinstance(value, bool):
                    infos.setdefault(key, []).append(float(value))
        total = max(len(results), 1)
        if not trajectories:
            raise RuntimeError(f"no agent episode of this batch ({len(results)} episodes) got an answer from its "
                               f"base URL (agent/errors={counts['errors']}, agent/timeouts={counts['timeouts']}; "
                               "see the warnings above): nothing to train on")
        metrics = {"agent/errors": float(counts["errors"]), "agent/timeouts": float(counts["timeouts"]),
                   "agent/segments_per_episode": sum(segment_counts) / total,
                   "agent/requests_per_episode": requests / total,
                   "agent/reward_mean": sum(r for r, _, _ in results) / total}
        metrics.update({f"agent/{key}": sum(v) / len(v) for key, v in infos.items()})
        return EpisodeResult(trajectories, scores, metrics, [[] for _ in trajectories])

    @staticmethod
    def _version(client: Any, policy_version: Any) -> int:
        """The weights version of sampled tokens the client reported none for."""
        if callable(policy_version):
            return int(policy_version())
        if policy_version is not None:
            return int(policy_version)
        return int(getattr(client, "weight_version", None) or 0)


def runner_from_config(cfg: Any, encoder: Any) -> AgentRunner:
    """The `AgentRunner` of a job config with `rollout.env: agent:...`: the agent function, the tool-call parser
    (`rollout.tool_parser`), the context (rollout.max_prompt_tokens + max_new_tokens), max_new_tokens per request,
    the chat template of `data.chat_template`, rollout.agent_timeout_s and rollout.max_concurrent_episodes."""
    from megarl.envs.tool_calls import get_parser

    r = cfg.rollout
    template = encoder.chat_template if getattr(encoder, "mode", "hf") == "jinja" else None
    limits = ServeLimits(max_model_len=r.max_prompt_tokens + r.max_new_tokens, max_tokens=r.max_new_tokens,
                         default_max_tokens=r.max_new_tokens,
                         max_in_flight=max(64, 2 * r.max_concurrent_episodes))
    return AgentRunner(load_agent(r.env), encoder.tokenizer, get_parser(r.tool_parser), limits,
                       parser_name=r.tool_parser if r.tool_parser in ("hermes", "qwen") else "hermes",
                       chat_template=template, agent_timeout_s=r.agent_timeout_s,
                       max_concurrent_episodes=r.max_concurrent_episodes)
