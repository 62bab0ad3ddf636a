"""A training run's lifecycle, around the step (`megarl/train.py` calls these; a step's own functions are
`megarl.stages`):

    build.py        the checks before any work; process groups, data, the actor and what the algorithm needs, the
                    engine, the rollout stage (`start` -> `TrainingRun`); and the end of the run (`close`)
    checkpoints.py  where a run starts (a checkpoint, or the HF weights: `resume`) and what a save holds (`save`)
    evaluate.py     held-out evaluation, before training, between steps and after
    export.py       the trained actor as an HF checkpoint (`--save-hf`) or PEFT adapters (`--save-peft`)
    log.py          the run's metrics log opened with its config beside it; the final report, the log closed

The order of construction is fixed (actor, reference, resume, critic, engine: `build.build_models`) because a
resumed run restores the RNG states in between.
"""
