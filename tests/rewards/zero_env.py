"""The calculator environment with every reward 0: the learning checks' control (what the RL steps do
by themselves, with no signal)."""

from tasks.common.envs.calculator import Environment as Calculator


class Environment(Calculator):
    def step(self, action):
        observation, _, done, info = super().step(action)
        return observation, 0.0, done, info
