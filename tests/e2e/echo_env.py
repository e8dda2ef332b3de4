"""A user environment file (`rollout.env: tests/e2e/echo_env.py:echo_env`) for the multi-turn end-to-end test: every
model turn gets an observation back (a user message echoing how many turns were taken) until `turns` turns, then the
episode ends with the fraction of distinct characters in the last turn (it varies between episodes, so GRPO updates
the weights). It makes every episode multi-turn whatever the policy samples, so a random model exercises the whole
loop (observation deltas, verification, pushes between turns)."""

from megarl.envs import EnvStep


class EchoEnv:
    def __init__(self, turns: int = 3) -> None:
        self.turns = turns

    def tools(self):
        return None

    async def reset(self, record):
        return [{"role": "user", "content": record.prompt}]

    async def step(self, turn):
        if turn.index + 1 >= self.turns:
            return EnvStep(reward=len(set(turn.text)) / max(len(turn.text), 1), done=True)
        return EnvStep(observations=({"role": "user", "content": f"turn {turn.index + 1} done, go on"},))

    async def close(self):
        pass


def echo_env(reward_fn=None, turns: int = 3) -> EchoEnv:
    return EchoEnv(turns)
