"""A number-guessing OpenEnv environment for the OpenEnv tests (`--openenv openenv_guess_env:GuessEnv`, with
tests/openenv_cpu on the path): `reset(target=N)` hides N; each `GuessAction(guess=G)` answers "higher K", "lower K"
or "correct K" (K: this instance's guesses since its reset, so state leaking between trajectories shows), with
reward 1.0 and the episode ended on the right number and 0.0 otherwise; the episode also ends after `max_tries`
guesses. One text field: the model sees it as it is (characters the tests' tiny tokenizer has)."""

from __future__ import annotations

from typing import Any, Optional

from openenv.core.env_server import Action, Environment, Observation, State


class GuessAction(Action):
    guess: int


class GuessObservation(Observation):
    hint: str


class GuessEnv(Environment):
    SUPPORTS_CONCURRENT_SESSIONS = True

    def __init__(self):
        super().__init__()
        self._state = State(step_count=0)
        self.target, self.max_tries = 0, 3

    def reset(self, seed: Optional[int] = None, episode_id: Optional[str] = None, target: int = 0,
              max_tries: int = 3, **kwargs: Any) -> GuessObservation:
        self._state = State(episode_id=episode_id, step_count=0)
        self.target, self.max_tries = int(target), int(max_tries)
        return GuessObservation(hint="guess 0", reward=None, done=False)

    def step(self, action: GuessAction, timeout_s: Optional[float] = None, **kwargs: Any) -> GuessObservation:
        if action.guess < 0:
            raise ValueError("a guess is never negative")
        self._state.step_count += 1
        n = self._state.step_count
        if action.guess == self.target:
            return GuessObservation(hint=f"correct {n}", reward=1.0, done=True)
        hint = "higher" if action.guess < self.target else "lower"
        return GuessObservation(hint=f"{hint} {n}", reward=0.0, done=n >= self.max_tries)

    @property
    def state(self) -> State:
        return self._state


class NotAnEnvironment:
    """For the error test: a class that is no OpenEnv Environment."""
