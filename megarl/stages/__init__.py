"""The stages of a training step, one module each, in the order `megarl/train.py` calls them:

    setup.py         preflight checks; process groups, data, actor, engine, rollout stage; resume and checkpoints
    colocation.py    the colocation cycle: who holds the accelerator; the weight sync into the engine
    collect.py       the rollout stage on every rank: prompts drawn, the rollout function, dynamic sampling and
                     overlong shaping around it
    algorithm.py     log-probs (old, reference), final rewards (KL in the reward) and advantages -> the TrainBatch
    critic_update.py the value model of estimators that need one (PPO's GAE): values, its update, its checkpoints
    update.py        the actor's loss and optimizer steps
    report.py        a step's metrics reduced over ranks; held-out evaluation, the final report, the HF export
"""
