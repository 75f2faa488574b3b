"""The guessing game with every reward 0: the control of the guess learning check."""

from tasks.common.envs.guess import Environment as Guess


class Environment(Guess):
    def step(self, action):
        observation, _, done, info = super().step(action)
        return observation, 0.0, done, info
