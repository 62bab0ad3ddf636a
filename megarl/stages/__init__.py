"""The stages of a training step, one module each, in the order `megarl/train.py` calls them (the run around the
steps, from construction to the end, is `megarl.trainer`):

    colocation.py    the colocation cycle: who holds the accelerator (`enter_rollout`, `enter_training`); the weight
                     sync into the engine (`WeightSync`)
    collect.py       the rollout stage on every rank: prompts drawn, the rollout function, dynamic sampling and
                     overlong shaping around it
    asynchronous.py  the rollout stage of asynchronous training (batches queued K steps ahead) and its staleness
                     check; the engine's side of it is `megarl.rollout.pipeline`
    algorithm.py     packing and log-probs (old, reference); then final rewards (KL in the reward) and advantages
                     -> the TrainBatch (`AlgorithmStage`)
    reward.py        the reward function metered for one rollout (`RewardMeter`), scoring rows as they finish; the
                     wait for the last rewards before the advantages
    critic_update.py the value model of estimators that need one (PPO's GAE): values, its update, its checkpoints
                     (`CriticStage`)
    update.py        the actor's loss and optimizer steps
    mismatch.py      train-inference mismatch: per step on the sampled tokens, and the whole-distribution check
                     at the weight sync (`--mismatch-check-interval`)
    report.py        a step's metrics reduced over ranks

`setup.py` is a shim for the names that moved to `megarl.trainer` (removed in megarl 0.3).
"""
