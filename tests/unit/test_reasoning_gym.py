"""The `reasoning_gym` verifier and `megarl-prepare-data reasoning-gym` against reasoning-gym's own scoring.

The reference is reasoning-gym itself: `reasoning_gym.utils.extract_answer` on the completion, then the task's
`score_answer` on the entry as the dataset made it (never through JSON). The verifier sees only what a data file
gives it: the label written by `megarl-prepare-data`, after a JSON round trip. Skipped without the `rg` extra
(`make test` installs it with `dev`).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

rg = pytest.importorskip("reasoning_gym", reason="reasoning-gym is the rg extra: pip install megarl[rg]")

from helpers import env  # noqa: E402
from reasoning_gym.utils import extract_answer  # noqa: E402

from megarl.errors import ConfigError  # noqa: E402
from megarl.tasks import reasoning_gym as rg_task  # noqa: E402
from megarl.verifiers import VERIFIERS  # noqa: E402
from megarl.verifiers.reasoning_gym import task_names  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
SEED, SIZE, ITEMS = 11, 3, 2
# Tasks without an `answer`: a right answer their own metadata holds (boxnet and rush_hour hold none: a plan would
# have to be searched for, so only wrong answers are compared for them)
RIGHT_FROM_METADATA = {
    "graph_color": lambda m: json.dumps(m["possible_answer"]),
    "propositional_logic": lambda m: m["example_answer"],
    "rubiks_cube": lambda m: m["example_correct_answer"],
}
WRONG = "<answer>zz 0 wrong</answer>"
# Over 2.5 s each on a shared 2-core machine (generating or scoring their items): marked slow
SLOW_TASKS = {"arc_agi", "knight_swap", "sokoban"}


@pytest.fixture(scope="module")
def verifier():
    return VERIFIERS.build("reasoning_gym")


def through_json(row: dict) -> dict:
    return json.loads(json.dumps(row))


def reference(dataset, completion: str, entry: dict) -> float:
    """reasoning-gym's own score of `completion` on `entry`: its reader, then the scorer of the dataset that made
    the entry (a scorer that raises on an answer it cannot parse, as prime_factorization's does on words, gives it
    0, as the verifier documents)."""
    try:
        return float(dataset.score_answer(extract_answer(completion), entry))
    except Exception:  # noqa: BLE001
        return 0.0


def right_answer(task: str, entry: dict) -> str | None:
    if entry["answer"] is not None:
        return entry["answer"]
    pick = RIGHT_FROM_METADATA.get(task)
    return pick(entry["metadata"]) if pick else None


@pytest.mark.parametrize("task", [pytest.param(t, marks=pytest.mark.slow) if t in SLOW_TASKS else t
                                  for t in task_names()])
def test_verifier_agrees_with_reasoning_gym_on_every_task(task, verifier):
    try:
        dataset = rg.create_dataset(task, seed=SEED, size=SIZE)
        entries = [dataset[i] for i in range(ITEMS)]
    except Exception as e:  # noqa: BLE001 - a task reasoning-gym cannot build here
        pytest.skip(f"reasoning-gym cannot build {task} here: {type(e).__name__}: {e}")
    for index, entry in enumerate(entries):
        label = through_json(rg_task.label(task, {}, SEED, SIZE, index, entry, dataset.score_answer))
        right = right_answer(task, entry)
        completions = [WRONG, "no tags at all"] + ([f"Thinking it over.\n<answer>{right}</answer>"] if right else [])
        for completion in completions:
            expected = reference(dataset, completion, entry)
            got = verifier.verify(completion, label)
            assert got.score == pytest.approx(expected), (task, index, completion[:80], got)
            assert (got.outcome == "correct") == (expected >= 1.0), (task, index, got)
        if right is not None:
            assert reference(dataset, completions[-1], entry) > 0, f"{task}: reasoning-gym gives its right answer 0"


def test_every_task_is_covered_and_metadata_tasks_are_among_them():
    names = task_names()
    assert len(names) >= 100 and "composite" not in names
    no_answer = [t for t in ("graph_color", "rush_hour", "boxnet", "propositional_logic", "rubiks_cube")
                 if rg.create_dataset(t, seed=SEED, size=SIZE)[0]["answer"] is None]
    assert no_answer == ["graph_color", "rush_hour", "boxnet", "propositional_logic", "rubiks_cube"]


# -- the pitfalls --------------------------------------------------------------------------------------------------


def test_only_the_extracted_answer_is_scored_never_the_completion(verifier):
    """The default scorer gives len(oracle)/len(answer) to any answer containing the oracle: scoring a whole
    completion that mentions the right number would pay for a wrong answer."""
    dataset = rg.create_dataset("chain_sum", seed=SEED, size=SIZE)
    entry = dataset[0]
    label = through_json(rg_task.label("chain_sum", {}, SEED, SIZE, 0, entry, dataset.score_answer))
    oracle = entry["answer"]
    completion = f"Maybe {oracle}? No: the answer is <answer>{int(oracle) + 1}</answer>"
    assert dataset.score_answer(completion, entry) > 0  # the pitfall is real: the whole completion earns credit
    got = verifier.verify(completion, label)
    assert got.score == 0.0 and got.outcome == "incorrect" and got.extracted == str(int(oracle) + 1)
    untagged = verifier.verify(f"the answer is {oracle}", label)
    assert untagged.score == 0.0 and untagged.outcome == "no_answer"
    # reasoning-gym's partial credit on the extracted answer itself is kept, as reasoning-gym scores it
    padded = f"<answer>{oracle}0</answer>"
    assert verifier.verify(padded, label).score == pytest.approx(reference(dataset, padded, entry))


def test_a_task_scored_from_metadata_keeps_its_entry(verifier):
    dataset = rg.create_dataset("graph_color", seed=SEED, size=SIZE)
    entry = dataset[1]
    label = through_json(rg_task.label("graph_color", {}, SEED, SIZE, 1, entry, dataset.score_answer))
    assert label["answer"] is None and label["entry"]["metadata"]["puzzle"]
    coloring = entry["metadata"]["possible_answer"]
    right = f"<answer>{json.dumps(coloring)}</answer>"
    assert verifier.verify(right, label).outcome == "correct"
    # a coloring that gives an edge's two ends the same colour
    u, v = entry["metadata"]["puzzle"]["edges"][0]
    clash = {**coloring, v: coloring[u]}
    wrong = f"<answer>{json.dumps(clash)}</answer>"
    assert verifier.verify(wrong, label).score == reference(dataset, wrong, entry) < 1.0


@pytest.mark.slow
def test_arc_agi_entries_are_rebuilt_not_read_back_from_json(verifier):
    dataset = rg.create_dataset("arc_agi", seed=SEED, size=SIZE)
    entry = dataset[0]
    completion = f"<answer>{entry['answer']}</answer>"
    # the pitfall: the same entry after JSON scores the right answer far below 1
    assert dataset.score_answer(entry["answer"], through_json(entry)) < 1.0 == dataset.score_answer(entry["answer"],
                                                                                                      entry)
    label = through_json(rg_task.label("arc_agi", {}, SEED, SIZE, 0, entry, dataset.score_answer))
    assert "entry" not in label
    assert verifier.verify(completion, label).score == 1.0
    # a label whose item another reasoning-gym release would generate differently is refused, not mis-scored
    stale = {**label, "question_sha256": "0" * 16}
    assert verifier.verify(completion, stale).outcome == "parse_error"


def test_labels_are_scored_with_their_own_config(verifier):
    config = {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1}
    [row] = list(rg_task.rows(["chain_sum"], {"chain_sum": config}, SEED, 1))
    row = through_json(row)
    assert row["answer"]["config"] == config and row["verifier"] == "reasoning_gym"
    assert "<answer>" in row["prompt"] and row["prompt"].startswith("State the final answer")
    right = f"<answer>{row['answer']['answer']}</answer>"
    assert verifier.verify(right, row["answer"]).score == 1.0


def test_bad_labels_are_parse_errors(verifier):
    for label in (None, "12", {"task": "chain_sum"}, {"task": "nope", "config": {}, "seed": 1, "size": 2, "index": 0}):
        got = verifier.verify("<answer>12</answer>", label)
        assert got.outcome == "parse_error" and got.score == 0.0, label


# -- megarl-prepare-data reasoning-gym -----------------------------------------------------------------------------


def read_rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_prepare_data_writes_rows_and_a_heldout_split_by_seed(tmp_path, capsys):
    from megarl.cli.prepare_data import main

    config = json.dumps({"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1})
    train, heldout = tmp_path / "train.jsonl", tmp_path / "heldout.jsonl"
    assert main(["reasoning-gym", "chain_sum", str(train), "--size", "150", "--seed", "1", "--config", config]) == 0
    rows = read_rows(train)
    assert len(rows) == 150 and {r["answer"]["seed"] for r in rows} == {1}
    # reasoning-gym makes item i of seed S from S + i: seed 2 would be seed 1 shifted by one item, so it is refused
    seed1, seed2 = (rg.create_dataset("chain_sum", seed=s, size=150, **json.loads(config)) for s in (1, 2))
    assert [seed2[i]["question"] for i in range(149)] == [seed1[i + 1]["question"] for i in range(149)]
    for seed in ("2", "150", "-100"):
        assert main(["reasoning-gym", "chain_sum", str(tmp_path / "x.jsonl"), "--size", "150", "--seed", seed,
                     "--config", config, "--exclude-from", str(train)]) == 2
        assert "a held-out split needs --seed >= 151 (or <= -149)" in capsys.readouterr().err
    assert not (tmp_path / "x.jsonl").exists()
    assert main(["reasoning-gym", "chain_sum", str(heldout), "--size", "150", "--seed", "151", "--config", config,
                 "--exclude-from", str(train)]) == 0
    err = capsys.readouterr().err
    held = read_rows(heldout)
    questions = {r["answer"]["entry"]["question"] for r in rows}
    assert held and not questions & {r["answer"]["entry"]["question"] for r in held}
    # 1-digit sums and differences are 200 questions, so even far-apart seeds share some: left out and counted
    assert f"{150 - len(held)} skipped: question in --exclude-from (chain_sum)" in err and len(held) < 150


def test_several_tasks_and_per_task_configs(tmp_path):
    out = tmp_path / "mix.jsonl"
    counts = rg_task.write("chain_sum,graph_color", out, size=3, seed=5,
                           config={"chain_sum": {"max_terms": 2}})
    rows = read_rows(out)
    assert counts["written"] == 6 and [r["answer"]["task"] for r in rows] == ["chain_sum"] * 3 + ["graph_color"] * 3
    assert rows[0]["answer"]["config"] == {"max_terms": 2} and rows[3]["answer"]["config"] == {}


@pytest.mark.parametrize("tasks, config, message", [
    ("chain_summ", None, "unknown reasoning-gym task 'chain_summ'; valid names include chain_sum"),
    ("", None, "name at least one reasoning-gym task"),
    ("chain_sum", "{bad", "--config: not valid JSON"),
    ("chain_sum", '{"min_term": 2}', "reasoning-gym refused the settings"),
    ("chain_sum", '{"seed": 2}', "'seed' is set by --seed"),
    ("chain_sum,gcd", '{"chain_sum": {}, "lcm": {}}', "'lcm' is none of them"),
])
def test_bad_input_is_a_clear_error(tmp_path, tasks, config, message):
    with pytest.raises(ConfigError, match=None) as e:
        rg_task.write(tasks, tmp_path / "o.jsonl", size=2, seed=1, config=config)
    assert message in str(e.value)
    assert not (tmp_path / "o.jsonl").exists()


def test_a_missing_extra_names_it(tmp_path):
    code = ("import sys; sys.modules['reasoning_gym'] = None\n"
            "from megarl.cli.prepare_data import main\n"
            f"rc = main(['reasoning-gym', 'chain_sum', {str(tmp_path / 'o.jsonl')!r}, '--size', '2', '--seed', '1'])\n"
            "from megarl.verifiers import VERIFIERS\n"
            "assert 'reasoning_gym' in VERIFIERS.names()\n"
            "try:\n    VERIFIERS.build('reasoning_gym')\nexcept Exception as e:\n    print('build:', e)\n"
            "sys.exit(rc)\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env(), cwd=REPO,
                          timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert "pip install megarl[rg]" in proc.stderr and "build: reasoning-gym is not installed" in proc.stdout
    assert not (tmp_path / "o.jsonl").exists()


@pytest.mark.slow
def test_megarl_verify_rescores_prepared_rows_in_reward_workers(tmp_path):
    """The rows as a file, through `megarl-verify`'s reward worker processes: labels travel as JSON there too."""
    rows = list(rg_task.rows(["chain_sum", "arc_agi"], {"chain_sum": {}, "arc_agi": {}}, SEED, 2))
    scored = tmp_path / "scored.jsonl"
    with open(tmp_path / "rows.jsonl", "w") as f:
        for i, row in enumerate(rows):
            answer = row["answer"]["answer"] if i % 2 == 0 else "nonsense"
            f.write(json.dumps({**row, "response": f"<answer>{answer}</answer>", "correct": i % 2 == 0}) + "\n")
    proc = subprocess.run([sys.executable, "-m", "megarl.cli.verify", str(tmp_path / "rows.jsonl"), "--workers", "1",
                           "--output", str(scored)], capture_output=True, text=True, env=env(), cwd=REPO, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert [r["outcome"] for r in read_rows(scored)] == ["correct", "incorrect"] * 2
