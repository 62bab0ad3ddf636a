"""A verifiers 0.4.0 taskset written for megarl's tests: `a+b=` / `a-b=` problems (the rows of a megarl prompt file
given in MEGARL_SUM_ROWS, one task per row, in order), rewarded 1.0 when the reply's first line is the answer.

Imported by the verifiers environment's interpreter only (`megarl/rollout/verifiers_worker.py`), never by
megarl's: the module name is the taskset id (`--verifiers-taskset megarl_sum_taskset`)."""

import json
import os

import verifiers.v1 as vf


class SumData(vf.TaskData):
    answer: str


class SumTask(vf.Task[SumData]):
    @vf.reward(weight=1.0)
    async def correct(self, task, trace) -> float:
        reply = (trace.last_reply or "").split("\n")[0].strip()
        return 1.0 if reply == task.answer else 0.0


class SumTaskset(vf.Taskset[SumTask]):
    def load(self):
        with open(os.environ["MEGARL_SUM_ROWS"]) as f:
            for line in f:
                if line.strip():
                    row = json.loads(line)
                    yield SumTask(SumData(prompt=row["prompt"], answer=str(row["answer"])))


__all__ = ["SumTaskset"]
